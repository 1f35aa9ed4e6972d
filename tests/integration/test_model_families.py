"""Models beyond the default, through two processes: tiny random transformers models
of five architectures (Llama, Qwen2, Qwen3 with head size 48, Mistral with every
layer a sliding window, Gemma3 interleaving sliding and full layers), each served
by a real ``lynx serve --model DIR`` process, decoded by a decode node in the
test process over UCX.

For each: Lynx's committed tokens equal greedy decoding on the plain INT8 cache
(computed here, independently of the nodes: each layer's kept positions quantized
to INT8 and back, one token a step) with anchors of 2, 3 and 4 bits; a sliding
layer sends its window's tokens only (a prompt of 4x the window); a cache
computed by another model - another shape, one perturbed projection, another
tokenizer - is refused at once, naming both models, and the
prefill node keeps serving.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lynx_bench.common.processes import Child
from lynx_decode.codec import decode_layer, encode_layer
from lynx_decode.codec.config import CodecConfig, Scheme
from lynx_decode.codec.layout import LayerLayout
from lynx_decode.decode_node import DecodeNode
from lynx_decode.errors import DecodeError
from lynx_decode.model import HFCausalLM, KVBuffers
from lynx_decode.timeouts import Timeouts
from tests._tiny_models import ARCHITECTURES, WINDOW, build

pytestmark = [pytest.mark.model, pytest.mark.ucx]

NEW_TOKENS = 12
POOL = 16 << 20
#: A prompt of four windows: a sliding layer keeps the last WINDOW - 1 of its positions.
PROMPT_TOKENS = 4 * WINDOW


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build(arch, root / arch, seed=i) for i, arch in enumerate(ARCHITECTURES)}


@pytest.fixture(scope="module")
def servers(dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[str, int]]]:
    """One ``lynx serve --model DIR`` per architecture, all started at once."""
    cache = tmp_path_factory.mktemp("lynx-cache")
    children: dict[str, Child] = {}
    logs = []
    try:
        for arch, directory in dirs.items():
            log = Path(tempfile.mkstemp(prefix=f"lynx-serve-{arch}-", suffix=".log")[1])
            logs.append(log)
            children[arch] = Child(f"lynx serve {arch}", [
                sys.executable, "-m", "lynx_bench.cli", "serve", "--listen", "127.0.0.1:0",
                "--model", str(directory), "--no-prefill-cache", "--threads", "1"], log,
                env={"LYNX_CACHE_DIR": str(cache)})
        addresses = {}
        for arch, child in children.items():
            host, port = child.expect("listening on", 300).rsplit(":", 1)
            addresses[arch] = (host, int(port))
        yield addresses
    finally:
        for child in children.values():
            child.stop()
        for log in logs:
            log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def models(dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, HFCausalLM]:
    cache = tmp_path_factory.mktemp("fingerprints")
    return {arch: HFCausalLM.load(d, cache_root=cache) for arch, d in dirs.items()}


def _prompt(model: HFCausalLM, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 256, PROMPT_TOKENS)]


def int8_greedy(model: HFCausalLM, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding, one token a step, on the INT8 codec's reconstruction of
    the cache: each layer's positions its attention still sees (a sliding layer its
    window's last ``WINDOW - 1``, quantized on their own: K's 64-token groups start
    at the window), what an INT8 stream carries."""
    prefill = model.prefill(ids)
    config = CodecConfig(Scheme.INT8)
    covered = len(ids) - 1
    kv = KVBuffers(model.info.kv_shape(covered), headroom=n + 2)
    for i in range(kv.shape.num_layers):
        kept = kv.shape.layer_tokens(i)
        k, v = (np.ascontiguousarray(x[:, covered - kept:]) for x in prefill.kv.layer(i))
        encoded = encode_layer(k, v, config)
        out_k, out_v = kv.layer(i)
        decode_layer(encoded.layout, encoded.buffers[0], out_k=out_k, out_v=out_v)
        kv.mark_written(i)
    cache = model.cache_from(kv)
    out, token = [], ids[-1]
    for _ in range(n):
        token = int(np.argmax(model.forward(cache, [token])[-1]))
        out.append(token)
        if token in model.info.eos_token_ids:
            break
    return out


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_lynx_equals_int8_greedy_for_every_architecture(arch: str, models: dict[str, HFCausalLM],
                                                          servers: dict[str, tuple[str, int]]) -> None:
    model, server = models[arch], servers[arch]
    info = model.info
    ids = _prompt(model, 7)
    reference = int8_greedy(model, ids, NEW_TOKENS)
    with DecodeNode(model, pool_bytes=POOL, timeouts=Timeouts(stream_s=60.0)) as node:
        int8 = node.run(server, ids, scheme=Scheme.INT8, max_new_tokens=NEW_TOKENS)
        assert list(int8.tokens) == reference
        for bits in (2, 3, 4):
            lynx = node.run(server, ids, scheme=Scheme.LYNX, anchor_bits=bits, max_new_tokens=NEW_TOKENS)
            assert list(lynx.tokens) == reference, f"{arch}, {bits}-bit anchors"
            assert lynx.metrics["verified"] is True
    # every layer's regions: a sliding layer's hold its window's last WINDOW - 1 tokens, a full one all
    covered = len(ids) - 1
    m = int8.metrics
    assert m["layer_windows"] == [g.window for g in info.layers]
    for i, g in enumerate(info.layers):
        kept = WINDOW - 1 if g.sliding else covered
        want = LayerLayout.build(CodecConfig(Scheme.INT8), g.kv_heads, kept, g.head_dim).plane_size(0)
        assert m["layer_bytes"][0][i] == want, f"layer {i}"
    assert m["bytes_total"] == 4 * len(ids) + sum(m["layer_bytes"][0])
    if info.sliding:
        assert m["bytes_total"] < m["bytes_naive"]
    else:
        assert m["bytes_total"] == m["bytes_naive"]


@pytest.mark.parametrize("variant, reason", [
    ("shape", r"layout \(layers, kv_heads, head_dim\) = \(4, 2, 16\) does not match .*\(3, 2, 16\)"),
    ("weights", "they differ in their weights:"),
    ("tokenizer", "they differ in their tokenizer:"),
])
def test_a_cache_from_another_model_is_refused_at_once(variant: str, reason: str, dirs: dict[str, Path],
                                                       models: dict[str, HFCausalLM],
                                                       servers: dict[str, tuple[str, int]],
                                                       tmp_path: Path) -> None:
    """The prefill node serves tiny Llama; this decode node runs a model that differs
    in its shape, in one projection's weights, or only in its tokenizer."""
    if variant == "shape":
        other = build("llama", tmp_path / "other", seed=0, num_hidden_layers=3)
    elif variant == "weights":
        other = build("llama", tmp_path / "other", seed=0, perturb="layers.1.self_attn.k_proj")
    else:
        other = build("llama", tmp_path / "other", seed=0, permuted_tokenizer=True)
    foreign = HFCausalLM.load(other, cache_root=tmp_path / "cache")
    ids = _prompt(foreign, 3)
    server = servers["llama"]
    with DecodeNode(foreign, pool_bytes=POOL, timeouts=Timeouts(stream_s=60.0)) as node:
        start = time.monotonic()
        with pytest.raises(DecodeError, match=reason) as refused:
            node.run(server, ids, scheme=Scheme.LYNX, max_new_tokens=NEW_TOKENS)
        # refused for its reason (the message), not timed out: a generous bound, a third of the
        # 60 s stream timeout (it takes well under a second)
        assert time.monotonic() - start < 20.0
    message = str(refused.value)
    assert models["llama"].info.model_id in message and foreign.info.model_id in message  # both named
    # the prefill node keeps serving: the right model decodes from it at once
    with DecodeNode(models["llama"], pool_bytes=POOL, timeouts=Timeouts(stream_s=60.0)) as node:
        ok = node.run(server, ids, scheme=Scheme.INT8, max_new_tokens=4)
    assert len(ok.tokens) >= 1


def _caches(model: HFCausalLM, ids: list[int], planes: tuple[int, ...], headroom: int) -> list[KVBuffers]:
    """The decode node's caches of ``ids`` (each layer its kept positions): one per
    prefix of the LYNX ``planes``, coarsest first; the last is the INT8 cache."""
    prefill = model.prefill(ids)
    config = CodecConfig(Scheme.LYNX, planes=planes)
    covered = len(ids) - 1
    out = [KVBuffers(model.info.kv_shape(covered), headroom=headroom) for _ in planes]
    for i in range(model.info.num_layers):
        kept = out[0].shape.layer_tokens(i)
        k, v = (np.ascontiguousarray(x[:, covered - kept:]) for x in prefill.kv.layer(i))
        encoded = encode_layer(k, v, config)
        for level, kv in enumerate(out):
            out_k, out_v = kv.layer(i)
            decode_layer(encoded.layout, *(encoded.buffers[p] for p in range(level + 1)), out_k=out_k, out_v=out_v)
            kv.mark_written(i)
    return out


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if "sliding" in a or "interleaved" in a])
def test_drafts_rolled_back_inside_a_window_still_commit_int8s_tokens(arch: str, models: dict[str, HFCausalLM]) -> None:
    """A prompt of four windows; the engine drafts on the 2-bit anchors of the windowed
    cache while the exact one is "in flight" (it lands after the sixth draft), verifies
    in one pass, rolls the rejected drafts back inside the window, and goes on."""
    import concurrent.futures as cf

    from lynx_decode.decode_config import CacheLevel, DecodeConfig
    from lynx_decode.events import Rollback, Tentative
    from lynx_decode.speculative import generate

    model = models[arch]
    assert model.info.sliding
    rolled_back = 0
    for seed in range(4):
        ids = _prompt(model, 100 + seed)
        draft, full = _caches(model, ids, (2, 6), headroom=NEW_TOKENS + 10)
        ready: cf.Future[KVBuffers] = cf.Future()
        ready.set_result(draft)
        landing: cf.Future[KVBuffers] = cf.Future()
        events: list[object] = []

        def on_event(event: object, landing: cf.Future[KVBuffers] = landing, full: KVBuffers = full,
                     events: list[object] = events) -> None:
            events.append(event)
            if isinstance(event, Tentative) and event.position == 5 and not landing.done():
                landing.set_result(full)  # the exact cache lands after the sixth draft

        gen = generate(model, ids, levels=[CacheLevel(ready), CacheLevel(landing)],
                       config=DecodeConfig(max_new_tokens=NEW_TOKENS, max_draft=8, wait_timeout_s=30.0),
                       t0=0.0, on_event=on_event)
        assert list(gen.tokens) == int8_greedy(model, ids, NEW_TOKENS)
        assert gen.metrics.drafted >= 6
        rolled_back += sum(isinstance(e, Rollback) for e in events)
    assert rolled_back > 0  # 2-bit drafts on a random model: some were wrong, and were rolled back


@pytest.mark.parametrize("planes", [(4, 4), (3, 5), (2, 2, 4)])
def test_each_layer_on_the_finest_level_in_still_commits_int8s_tokens(planes: tuple[int, ...],
                                                                      models: dict[str, HFCausalLM]) -> None:
    """The real model, layers on mixed levels: before the first step the exact K/V of every
    third layer is in, a middle level (2,2,4) of the next ones, the anchors of the rest land
    as the pass reaches them; the rest of each level lands after a few drafts (drafting on
    the mixed cache, a verify pass on the finest levels per layer, rollbacks). The committed
    tokens are INT8's; the first pass read what was in. Then every layer exact as the pass
    reaches it: the first token is final, no verify pass."""
    import concurrent.futures as cf

    from lynx_decode.decode_config import CacheLevel, DecodeConfig
    from lynx_decode.events import Committed, Rollback
    from lynx_decode.speculative import decode_events
    from tests._speculative_helpers import Landing, LandsWith, check_events

    model = models["llama"]
    layers, last = model.info.num_layers, len(planes) - 1
    rolled_back = 0
    for seed in range(3):
        ids = _prompt(model, 200 + seed)
        reference = int8_greedy(model, ids, NEW_TOKENS)
        bufs = [Landing(kv, cf.Future()) for kv in _caches(model, ids, planes, headroom=NEW_TOKENS + 10)]
        for i in range(0, layers, 3):
            bufs[last].land(i)
        if last == 2:
            for i in range(1, layers, 3):
                bufs[1].land(i)
        events: list[object] = []
        for event in decode_events(model, ids, levels=[CacheLevel(kv.future, kv) for kv in bufs],
                                   config=DecodeConfig(max_new_tokens=NEW_TOKENS, max_draft=8),
                                   t0=0.0):
            events.append(event)
            if len(events) == 3 + seed:
                for kv in bufs:
                    kv.land_all()
        check_events(events, reference)  # type: ignore[arg-type]
        m = events[-1].metrics  # type: ignore[attr-defined]
        want = [last if i % 3 == 0 else (1 if last == 2 and i % 3 == 1 else 0) for i in range(layers)]
        assert list(m.first_pass_levels) == want and not m.first_token_committed and m.verify_passes >= 1
        rolled_back += sum(isinstance(e, Rollback) for e in events)

        # the residual of each layer lands as the pass reaches it: exact in every layer, final at once
        bufs = [Landing(kv, cf.Future()) for kv in _caches(model, ids, planes, headroom=NEW_TOKENS + 10)]
        anchor = LandsWith(bufs[0].source, cf.Future(), bufs[last])
        chain = [CacheLevel(anchor.future, anchor), *(CacheLevel(kv.future, kv) for kv in bufs[1:])]
        events = list(decode_events(model, ids, levels=chain,
                                    config=DecodeConfig(max_new_tokens=NEW_TOKENS), t0=0.0))
        assert list(events[-1].tokens) == reference  # type: ignore[union-attr]
        m = events[-1].metrics  # type: ignore[union-attr]
        assert m.first_token_committed and m.verify_passes == 0 and set(m.first_pass_levels) == {last}
        assert all(isinstance(e, Committed) for e in events[:-1])
    assert rolled_back > 0  # coarse drafts on a random model: some were rolled back
