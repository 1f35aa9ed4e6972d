"""The prefill and decode nodes end to end over every transport (the ``transport``
fixture: the in-memory twin, well under a second a test, and real UCX), with a
toy model: requests, every scheme, refusals, admission, many requests from many
decode nodes at once, a decode node that goes away.

The same nodes with the real model in two processes run in
tests/integration/test_kv_two_process.py; here only the model is a twin (the
codec, the KV stream path, the assembler and the engine are real).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from lynx_decode.codec.config import CodecConfig, Scheme
from lynx_decode.decode_node import DecodeNode
from lynx_decode.errors import DecodeError, ServerBusyError
from lynx_decode.events import Event, Tentative
from lynx_decode.kvheader import cache_bytes
from lynx_decode.kvsend import warm_up_codec
from lynx_decode.model.protocol import Prefill
from lynx_decode.prefill_node import DEFAULT_PREPARE, PrefillNode
from lynx_decode.send_record import RecordsFile, read_records, wait_record
from lynx_decode.timeouts import Timeouts
from lynx_transport.errors import ConnectError
from lynx_transport.seam import Transport
from lynx_transport.testing import wait_until
from tests._speculative_helpers import ToyLM


class NodeToyLM(ToyLM):
    """The engine's toy model with the text side the nodes use."""

    def tokenize(self, text: str) -> list[int]:
        return [1 + (ord(c) % 30) for c in text]

    def chat_prompt(self, message: str) -> list[int]:
        return [2, *self.tokenize(message)]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return " ".join(map(str, token_ids))


PROMPT = [5, 9, 3, 7] * 40
POOL = 8 << 20


@pytest.fixture(scope="module", autouse=True)
def _warm() -> None:
    warm_up_codec()


@pytest.fixture
def nodes(transport: Transport) -> Iterator[tuple[PrefillNode, DecodeNode, Transport]]:
    model = NodeToyLM(eos=False)
    waits = Timeouts(stream_s=5.0)
    with PrefillNode(model, transport=transport, timeouts=waits) as prefill, \
            DecodeNode(model, transport=transport, timeouts=waits, pool_bytes=POOL) as decode:
        stop = threading.Event()
        server = threading.Thread(target=prefill.serve, args=(stop,), kwargs={"poll_s": 0.02})
        server.start()
        try:
            yield prefill, decode, transport
        finally:
            stop.set()
            server.join(5)


def test_lynx_commits_exactly_what_int8_decodes(nodes: Any) -> None:
    prefill, decode, _ = nodes
    int8 = decode.run(prefill.address, PROMPT, scheme=Scheme.INT8, max_new_tokens=12)
    events: list[Event] = []
    # the residual held until the first token is out: the toy's cache would otherwise land
    # whole before the first step (then every layer reads exact K/V and nothing is drafted)
    lynx = decode.run(prefill.address, PROMPT, scheme=Scheme.LYNX, max_new_tokens=12,
                      on_event=events.append, hold_residual=True)
    assert lynx.tokens == int8.tokens and len(lynx.tokens) == 12
    assert lynx.metrics["first_pass_levels"] == [0] and not lynx.metrics["first_token_committed"]
    m = int8.metrics  # one decode step: the 11 greedy steps after the first token
    assert m["step_s"] == pytest.approx((m["e2e_s"] - m["ttfct_s"]) / 11)
    assert lynx.metrics["verified"] is True
    assert any(isinstance(e, Tentative) for e in events)
    assert lynx.metrics["bytes_residual"] > 0 and int8.metrics["bytes_residual"] == 0
    assert lynx.metrics["bytes_anchor"] < int8.metrics["bytes_anchor"]
    assert wait_until(lambda: prefill.served == 2, 5)  # counted once the confirmation is back


def test_auto_split_follows_the_link(nodes: Any) -> None:
    prefill, decode, _ = nodes
    first = decode.run(prefill.address, PROMPT, scheme=Scheme.LYNX, planes="auto", max_new_tokens=6)
    assert first.metrics["planes"] == [4, 4] and "default" in first.metrics["split_choice"]
    fast = decode.run(prefill.address, PROMPT, scheme=Scheme.LYNX, planes="auto", max_new_tokens=6,
                      bandwidth_gbps=100.0)
    assert fast.metrics["scheme"] == "int8" and fast.metrics["planes"] is None
    assert "no split" in fast.metrics["split_choice"]
    slow = decode.run(prefill.address, PROMPT, scheme=Scheme.LYNX, planes="auto", max_new_tokens=6,
                      bandwidth_gbps=1e-4)
    assert slow.metrics["planes"] == [3, 5] and slow.tokens == fast.tokens
    # INT8 asked for stays INT8
    assert decode.run(prefill.address, PROMPT, scheme=Scheme.INT8, planes="auto",
                      max_new_tokens=6).metrics["split_choice"] is None


class CountingToyLM(NodeToyLM):
    def __init__(self) -> None:
        super().__init__(eos=False)
        self.prefills = 0

    def prefill(self, token_ids: Sequence[int]) -> Prefill:
        self.prefills += 1
        return super().prefill(token_ids)


@pytest.mark.parametrize("hold_native", [False, True])
def test_a_prompt_is_held_encoded_and_a_pull_of_a_held_form_sends_at_once(transport: Transport,
                                                                          hold_native: bool) -> None:
    model = CountingToyLM()
    waits = Timeouts(stream_s=5.0)
    held_forms = cache_bytes(model.info.layers, len(PROMPT) - 1, CodecConfig(Scheme.BF16))
    prepared = sum(cache_bytes(model.info.layers, len(PROMPT) - 1, c) for c in DEFAULT_PREPARE)
    native = 2 * 4 * (len(PROMPT) - 1) * model.info.num_layers  # K and V, float32, one head of size 1
    with PrefillNode(model, transport=transport, timeouts=waits, hold_native=hold_native) as prefill, \
            DecodeNode(model, transport=transport, timeouts=waits, pool_bytes=POOL) as decode:
        int8 = decode.run(prefill.address, PROMPT, scheme=Scheme.INT8, max_new_tokens=6)
        # prefilled once, encoded into the pulled form and every prepared one; float32 dropped
        assert model.prefills == 1
        assert prefill.held_bytes == prepared + (native if hold_native else 0)
        assert prepared == cache_bytes(model.info.layers, len(PROMPT) - 1, CodecConfig(Scheme.INT8))
        for planes in ((4, 4), (3, 5), (2, 2, 4)):  # cut from the held INT8 codes: no prefill, nothing more held
            lynx = decode.run(prefill.address, PROMPT, scheme=Scheme.LYNX, planes=planes, max_new_tokens=6)
            assert lynx.tokens == int8.tokens and model.prefills == 1
            assert prefill.held_bytes == prepared + (native if hold_native else 0)
        # a form nobody prepared: from the float32 cache when held, else prefilled again
        bf16 = decode.run(prefill.address, PROMPT, scheme=Scheme.BF16, max_new_tokens=6)
        assert bf16.tokens == int8.tokens and model.prefills == (1 if hold_native else 2)
        assert prefill.held_bytes == prepared + held_forms + (native if hold_native else 0)
        assert wait_until(lambda: prefill.served == 5, 5)  # counted once the confirmation is back
        assert prefill.failed == 0


def test_a_split_named_in_prepare_is_held_ready_beside_int8(transport: Transport) -> None:
    model = CountingToyLM()
    waits = Timeouts(stream_s=5.0)
    ready = CodecConfig(Scheme.LYNX, planes=(4, 4))
    forms = sum(cache_bytes(model.info.layers, len(PROMPT) - 1, c) for c in (CodecConfig(Scheme.INT8), ready))
    prepare = (CodecConfig(Scheme.INT8), ready)
    with PrefillNode(model, transport=transport, timeouts=waits, prepare=prepare) as prefill, \
            DecodeNode(model, transport=transport, timeouts=waits, pool_bytes=POOL) as decode:
        runs = [decode.run(prefill.address, PROMPT, scheme=Scheme.LYNX, planes=planes, max_new_tokens=6)
                for planes in ((4, 4), (3, 5))]  # the one held ready, and one cut from INT8
        assert runs[0].tokens == runs[1].tokens and model.prefills == 1
        assert prefill.held_bytes == forms


def test_with_no_memory_cache_nothing_is_held_and_each_pull_prefills(transport: Transport) -> None:
    # (the vLLM producer's node: its caches are vLLM's, held by HeldPrefills, not here)
    model = CountingToyLM()
    waits = Timeouts(stream_s=5.0)
    with PrefillNode(model, transport=transport, timeouts=waits, memory_cache=0) as prefill, \
            DecodeNode(model, transport=transport, timeouts=waits, pool_bytes=POOL) as decode:
        for scheme in (Scheme.INT8, Scheme.LYNX):
            decode.run(prefill.address, PROMPT, scheme=scheme, max_new_tokens=4)
        assert model.prefills == 2 and prefill.held_bytes == 0
        assert wait_until(lambda: prefill.served == 2, 5)


def test_each_sent_request_leaves_a_record_its_decode_node_can_join(transport: Transport, tmp_path: Path) -> None:
    model = CountingToyLM()
    waits = Timeouts(stream_s=5.0)
    records = RecordsFile(tmp_path / "records.jsonl")
    with PrefillNode(model, transport=transport, timeouts=waits, on_sent=records) as prefill, \
            DecodeNode(model, transport=transport, timeouts=waits, pool_bytes=POOL) as decode:
        runs = [decode.run(prefill.address, PROMPT, scheme=scheme, max_new_tokens=4)
                for scheme in (Scheme.INT8, Scheme.LYNX)]
        assert wait_until(lambda: prefill.served == 2, 5)
    records.close()
    for run, scheme in zip(runs, ("int8", "lynx"), strict=True):
        got = wait_record(tmp_path / "records.jsonl", run.metrics["request_id"], 5.0)
        assert got is not None and got["scheme"] == scheme
        assert got["t0_unix"] == run.metrics["t0_unix"]  # the same t0 the KV header carried
        # the first byte went out after t0 and before the receiver confirmed the stream
        assert 0 <= got["first_byte_s"] <= got["sent_s"]
        assert got["bytes_anchor"] == run.metrics["bytes_anchor"]
        assert got["held_bytes"] == prefill.held_bytes  # one prompt: everything held is its
    assert read_records(tmp_path / "records.jsonl").keys() == {r.metrics["request_id"] for r in runs}


@pytest.mark.parametrize("scheme", [Scheme.BF16, Scheme.INT8, Scheme.INT4, Scheme.LYNX])
def test_every_scheme_round_trips(nodes: Any, scheme: Scheme) -> None:
    prefill, decode, _ = nodes
    result = decode.run(prefill.address, PROMPT, scheme=scheme, max_new_tokens=6)
    assert len(result.tokens) == 6 and result.text
    assert result.metrics["ttft_s"] is not None and result.metrics["ttft_s"] > 0
    assert result.metrics["scheme"] == scheme.value


def test_a_refused_request_fails_the_run_with_the_reason(nodes: Any) -> None:
    prefill, decode, _ = nodes
    # a prompt longer than the model: the prefill node's model refuses it (as HFCausalLM does),
    # the run hears the reason (not a timeout) at once, and the prefill node counts it failed
    start = time.monotonic()
    refused = "refused the request: the prompt has 5000 tokens; the model's context window is 4096"
    with pytest.raises(DecodeError, match=refused):
        decode.run(prefill.address, "x" * 5000, scheme=Scheme.INT8, max_new_tokens=4)
    assert time.monotonic() - start < decode.timeouts.stream_s  # a generous bound: not waited out
    assert wait_until(lambda: prefill.failed == 1 and prefill.pending == 0, 10)
    assert prefill.served == 0
    # and the node serves the next request
    assert len(decode.run(prefill.address, PROMPT, scheme=Scheme.INT8, max_new_tokens=3).tokens) == 3


def test_a_stream_the_decode_node_cannot_take_is_refused_with_the_reason(transport: Transport) -> None:
    # a prefill node whose model has more positions than the decode node's: the decode node
    # refuses the stream at its opening and the run hears why at once.
    # The prefill node's send fails if the refusal beats the last byte; a small stream can land
    # whole first (the transport completes it before the receiver's callback runs), and then the
    # send succeeded: either way the request ends, and both nodes serve the next one.
    waits = Timeouts(stream_s=5.0)
    with PrefillNode(NodeToyLM(eos=False, max_positions=8192), transport=transport, timeouts=waits) as prefill, \
            DecodeNode(NodeToyLM(eos=False), transport=transport, timeouts=waits, pool_bytes=POOL) as decode:
        stop = threading.Event()
        server = threading.Thread(target=prefill.serve, args=(stop,), kwargs={"poll_s": 0.02})
        server.start()
        try:
            start = time.monotonic()
            with pytest.raises(DecodeError, match="more than the model's 4096 positions"):
                decode.run(prefill.address, "x" * 5000, scheme=Scheme.INT8, max_new_tokens=4)
            assert time.monotonic() - start < decode.timeouts.stream_s
            assert wait_until(lambda: prefill.failed + prefill.served == 1 and prefill.pending == 0, 10)
            assert len(decode.run(prefill.address, PROMPT, scheme=Scheme.INT8, max_new_tokens=3).tokens) == 3
        finally:
            stop.set()
            server.join(5)


def test_nobody_listening_fails_at_once(transport: Transport) -> None:
    with DecodeNode(NodeToyLM(), transport=transport, timeouts=Timeouts(stream_s=5.0),
                    pool_bytes=POOL) as decode, \
            pytest.raises(ConnectError):
        decode.run(("127.0.0.1", 1), PROMPT, scheme=Scheme.INT8, max_new_tokens=3)


class GatedLM(NodeToyLM):
    """Prefills wait for ``gate`` (a prefill node busy with a long prompt)."""

    def __init__(self) -> None:
        super().__init__(eos=False)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def prefill(self, token_ids: Sequence[int]) -> Any:
        self.entered.set()
        assert self.gate.wait(10)
        return super().prefill(token_ids)


def _serving(prefill: PrefillNode) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=prefill.serve, args=(stop,), kwargs={"poll_s": 0.02})
    thread.start()
    return stop, thread


def test_past_the_admission_limit_a_request_is_refused_as_busy_at_once(transport: Transport) -> None:
    model = GatedLM()
    waits = Timeouts(stream_s=10.0)
    with PrefillNode(model, transport=transport, timeouts=waits, max_pending=1, memory_cache=0) as prefill, \
            DecodeNode(model, transport=transport, timeouts=waits, pool_bytes=POOL) as a, \
            DecodeNode(model, transport=transport, timeouts=waits, pool_bytes=POOL) as b:
        stop, server = _serving(prefill)
        first: list[Any] = []
        runner = threading.Thread(target=lambda: first.append(
            a.run(prefill.address, PROMPT, scheme=Scheme.LYNX, max_new_tokens=4)))
        runner.start()
        try:
            assert model.entered.wait(5)  # A is admitted and prefilling
            start = time.monotonic()
            with pytest.raises(ServerBusyError, match="busy"):
                b.run(prefill.address, PROMPT, scheme=Scheme.INT8, max_new_tokens=4)
            # refused while A still holds the only slot (its prefill waits for the gate): B was
            # not queued behind A, and not left to its stream timeout (a generous bound)
            assert runner.is_alive() and not first and prefill.pending == 1
            assert time.monotonic() - start < waits.stream_s / 2
            assert prefill.refused == 1
        finally:
            model.gate.set()
            runner.join(10)
        assert len(first[0].tokens) == 4  # A was served
        # and, once A is finished, the node serves the next request
        assert wait_until(lambda: prefill.pending == 0, 5)
        assert len(b.run(prefill.address, PROMPT, scheme=Scheme.INT8, max_new_tokens=3).tokens) == 3
        stop.set()
        server.join(5)


def test_many_requests_from_many_decode_nodes_at_once(transport: Transport,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    model = NodeToyLM(eos=False)
    waits = Timeouts(stream_s=10.0)
    prompts = [[5, 9, 3, 7] * 40, [2, 8, 6] * 50, [4, 1] * 70]
    with PrefillNode(model, transport=transport, timeouts=waits) as prefill:
        decoders = [DecodeNode(model, transport=transport, timeouts=waits, pool_bytes=4 * POOL)
                    for _ in range(3)]
        stop, server = _serving(prefill)
        try:
            reference = {i: decoders[0].run(prefill.address, p, scheme=Scheme.INT8, max_new_tokens=8).tokens
                         for i, p in enumerate(prompts)}
            results: dict[tuple[int, int], Any] = {}
            errors: list[BaseException] = []

            def one(node: int, k: int) -> None:
                try:
                    results[node, k] = decoders[node].run(prefill.address, prompts[k % 3],
                                                          scheme=Scheme.LYNX, max_new_tokens=8)
                except BaseException as exc:  # forwarded to the test thread
                    errors.append(exc)

            with caplog.at_level("INFO", logger="lynx_decode.prefill"):
                threads = [threading.Thread(target=one, args=(n, k)) for n in range(3) for k in range(4)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(30)
                # a request's line is logged once its confirmation is back at the prefill node
                assert wait_until(lambda: prefill.pending == 0, 5)
            assert not errors, errors
            assert len(results) == 12
            for (_, k), result in results.items():
                assert result.tokens == reference[k % 3]  # every LYNX request commits INT8's tokens
                assert result.metrics["ttft_from_request_s"] >= result.metrics["ttft_s"]
                assert result.metrics["queue_s"] >= 0
            lines = [r.getMessage() for r in caplog.records if "tokens, lynx planes=4,4" in r.getMessage()]
            assert len(lines) == 12
            assert "anchor" in lines[0] and "residual" in lines[0] and "sent in" in lines[0]
        finally:
            stop.set()
            server.join(5)
            for d in decoders:
                d.close()


def test_a_decode_node_that_goes_away_fails_only_its_own_requests(transport: Transport) -> None:
    model = GatedLM()
    waits = Timeouts(stream_s=10.0)
    with PrefillNode(model, transport=transport, timeouts=waits, memory_cache=0) as prefill, \
            DecodeNode(model, transport=transport, timeouts=waits, pool_bytes=POOL) as survivor:
        doomed = DecodeNode(model, transport=transport, timeouts=waits, pool_bytes=POOL)
        stop, server = _serving(prefill)
        try:
            model.gate.set()
            assert len(doomed.run(prefill.address, PROMPT, scheme=Scheme.INT8, max_new_tokens=2).tokens) == 2
            assert doomed.address in prefill.peers()
            model.gate.clear()
            model.entered.clear()
            failed: list[BaseException] = []

            def doomed_run() -> None:
                try:
                    doomed.run(prefill.address, PROMPT, scheme=Scheme.LYNX, max_new_tokens=4)
                except BaseException as exc:  # expected: its node goes away
                    failed.append(exc)

            runner = threading.Thread(target=doomed_run)
            runner.start()
            assert model.entered.wait(5)  # its request is prefilling at the prefill node
            doomed.close()                # ... when the decode node goes away
            runner.join(10)
            assert failed, "the dead node's own run must fail"
            model.gate.set()
            ok = survivor.run(prefill.address, PROMPT, scheme=Scheme.LYNX, max_new_tokens=4)
            assert len(ok.tokens) == 4
            # back to idle: nothing pending, the dead node's connection forgotten
            assert wait_until(lambda: prefill.pending == 0, 5)
            assert wait_until(lambda: doomed.address not in prefill.peers(), 5)
            assert prefill.peers() == [survivor.address]
            assert prefill.failed == 1
        finally:
            stop.set()
            server.join(5)
