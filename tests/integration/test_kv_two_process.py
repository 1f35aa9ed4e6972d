"""Speculative decoding across two processes over UCX, on the real model.

The prefill node is a real ``lynx serve`` process; the decode node runs in the
test process. The link is held to a low rate by the sender's shaper so the
residual is still in flight while the decode node drafts.
"""

from __future__ import annotations

import os
import signal

import pytest

from lynx_bench.accuracy.workload import filler_prose, passkey_prompt
from lynx_decode.codec.config import Scheme
from lynx_decode.decode_config import MissingFull
from lynx_decode.decode_node import DecodeNode
from lynx_decode.errors import DecodeError, PromptError
from lynx_decode.events import Committed, Event, Tentative, Unverified
from lynx_decode.timeouts import Timeouts
from lynx_transport.errors import LynxError

from .nodes import serve_process

pytestmark = [pytest.mark.model, pytest.mark.ucx]

NEW_TOKENS = 32
#: Slow enough that a 2k-token residual (~12 MB) takes ~1 s: several drafts happen.
SLOW_GBPS = 0.1


@pytest.fixture(scope="module")
def model():
    from lynx_decode.model import HFCausalLM

    return HFCausalLM.load()


@pytest.fixture(scope="module")
def server():
    with serve_process() as (_child, address):
        yield address


@pytest.fixture(scope="module")
def node(model):
    with DecodeNode(model, timeouts=Timeouts(stream_s=120.0)) as n:
        yield n


def _prompts(model) -> list[list[int]]:
    """Five prompts of >= 2k tokens: three pass-key (needle at different depths) and
    two free-text, with seeds never used for tuning (101..105)."""
    out = [model.tokenize(passkey_prompt(model.tokenize, 2100, depth, seed).prompt)
           for depth, seed in ((0.2, 101), (0.6, 102), (0.95, 103))]
    out += [model.tokenize(filler_prose(model.tokenize, 2100, seed)) for seed in (104, 105)]
    assert all(len(ids) >= 2000 for ids in out)
    return out


def test_lynx_equals_int8_token_for_token(model, server, node) -> None:
    drafted = 0
    for ids in _prompts(model):
        int8 = node.run(server, ids, scheme=Scheme.INT8, max_new_tokens=NEW_TOKENS)
        assert len(int8.tokens) == NEW_TOKENS
        for planes in ((4, 4), (3, 5), (2, 2, 4)):
            events: list[Event] = []
            # the residual held until the first tentative token is out: speculation happens by
            # design, not because this machine was fast enough to draft before the residual landed
            lynx = node.run(server, ids, scheme=Scheme.LYNX, planes=planes,
                            max_new_tokens=NEW_TOKENS, bandwidth_gbps=SLOW_GBPS,
                            on_event=events.append, hold_residual=True)
            assert lynx.tokens == int8.tokens, f"planes {planes}"
            committed = [t for e in events if isinstance(e, Committed) for t in e.tokens]
            assert tuple(committed) == lynx.tokens
            drafted += lynx.metrics["drafted"]
    # Speculation really happened (the held residual makes sure of it). Whether a wrong draft
    # shows as a Rollback depends on how many tokens this machine drafted before the residual
    # landed, so it is not asserted here (measured: 0 of 15 runs on a loaded box); rollbacks
    # are checked without a clock in tests/unit/test_speculative.py and test_speculative_model.py.
    assert drafted > 0


def _landed_by(m: dict, planes: range) -> float:
    """When the last region of ``planes`` landed (the assembler's clock, as the engine's)."""
    return max(t for plane in planes for t in m["arrivals_s"][plane])


@pytest.fixture(scope="module")
def slow_run(model, server, node) -> tuple[dict, list[Event]]:
    """One LYNX run over the slow link: its metrics and its events."""
    ids = model.tokenize(filler_prose(model.tokenize, 2100, 106))
    events: list[Event] = []
    result = node.run(server, ids, scheme=Scheme.LYNX, max_new_tokens=8, bandwidth_gbps=SLOW_GBPS,
                      on_event=events.append)
    return result.metrics, events


def test_decoding_starts_on_the_anchors(slow_run) -> None:
    m, events = slow_run
    # the first tokens are drafts on the anchor-only cache, withdrawn or committed only later
    assert isinstance(events[0], Tentative), events[:3]
    assert m["drafted"] >= 1
    assert m["ttft_s"] < m["ttfct_s"]
    # by design: the first tentative token needs every anchor region, the first committed one
    # every region; strict priority puts the anchor lane's last byte before the residual's
    assert _landed_by(m, range(1)) <= m["first_tentative_s"]
    assert _landed_by(m, range(len(m["arrivals_s"]))) <= m["ttfct_s"]
    assert m["transfer_anchor_s"] < m["transfer_residual_s"]


@pytest.mark.timing
def test_decoding_starts_before_the_residual_lands(slow_run, timing) -> None:
    m, _ = slow_run
    # the first step (~a decode step after the last anchor) is done long before the residual
    # (~1 s at 0.1 Gbit/s) lands: timestamps from the first token and the lane completion
    timing.less_than("first tentative token, against the residual lane's completion",
                     m["first_tentative_s"], m["transfer_residual_s"])


@pytest.fixture(scope="module", params=[SLOW_GBPS, 1.0])
def residual_run(request: pytest.FixtureRequest, model, server, node) -> tuple[float, dict]:
    """One LYNX run per link rate, the residual sent right behind the anchors (not held)."""
    ids = model.tokenize(filler_prose(model.tokenize, 2100, 107))
    m = node.run(server, ids, scheme=Scheme.LYNX, max_new_tokens=8, bandwidth_gbps=request.param,
                 hold_residual=False).metrics
    return request.param, m


def _clocks(m: dict) -> dict:
    return {k: m[k] for k in ("transfer_anchor_s", "first_residual_s", "first_tentative_s", "full_taken_s",
                              "transfer_residual_s", "ttfct_s", "drafted")}


def test_the_residual_follows_the_anchors_and_verification_reads_it(residual_run) -> None:
    """What the design guarantees, however busy the machine: the run is verified, every
    anchor region landed before the first tentative token (if the engine drafted: on a
    busy machine the residual may land before its first step), every region before the
    first committed token, the verify pass after the engine took the full cache, and the
    anchor lane completed before the residual lane (strict priority)."""
    _, m = residual_run
    clocks = _clocks(m)
    assert m["verified"] is True and m["bytes_residual"] > 0, clocks
    if m["first_tentative_s"] is not None:
        assert _landed_by(m, range(1)) <= m["first_tentative_s"], clocks
    assert _landed_by(m, range(len(m["arrivals_s"]))) <= m["ttfct_s"], clocks
    assert m["full_taken_s"] <= m["ttfct_s"], clocks
    assert m["transfer_anchor_s"] < m["transfer_residual_s"], clocks


@pytest.mark.timing
def test_the_residual_never_waits_and_verification_rides_on_it(model, residual_run, timing) -> None:
    gbps, m = residual_run
    # The receiver sees a region only once it has landed whole (one layer's plane: 32 ms at
    # 0.1 Gbit/s, 3 ms at 1 Gbit/s), so: at both rates the link does not idle between the lanes
    # (the first residual region lands within two region times of the last anchor) ...
    region_s = m["bytes_residual"] / model.info.num_layers * 8 / (gbps * 1e9)
    timing.at_most(f"{gbps:g} Gbit/s: first residual region after the anchor lane's completion",
                   m["first_residual_s"] - m["transfer_anchor_s"], 2 * region_s)
    if gbps >= 1.0:
        # ... and where a region is shorter than the first step's tail, the link carried residual
        # bytes before the first tentative token was out: the first residual region landed at
        # first_residual_s, so its bytes were on the link from its size at the link rate before
        # that (at 0.1 Gbit/s the 8 ms tail is within one region's time: not resolvable here)
        assert m["first_tentative_s"] is not None, _clocks(m)
        timing.less_than(f"{gbps:g} Gbit/s: first residual region on the link, against the first tentative token",
                         m["first_residual_s"] - region_s, m["first_tentative_s"])
    # ... and, where the residual was still on the link when the first tentative token came out,
    # the verify pass started before the residual lane completed (it waits per layer), which
    # completed before the first committed token. Where the first step outlasted the whole
    # residual there is nothing left to ride on (on the 2-core box on 2026-12-03 the first step
    # at 1 Gbit/s took 0.22 s and the residual 0.21 s, with this code and the code before it):
    # then the engine takes the full cache right after that step, within one more step.
    # Where each layer's residual landed before the first step reached that layer, the step read
    # exact K/V in every layer: nothing was drafted and the first token came out final, with no
    # verify pass (issue 26's rule; seen at 1 Gbit/s on the 2-core box on 2026-12-04, where the
    # first step and the residual both take ~0.21 s).
    if m["draft_start_s"] is None:
        assert m["first_token_committed"] and m["verify_passes"] == 0, _clocks(m)
        assert set(m["first_pass_levels"]) == {len(m["arrivals_s"]) - 1}, _clocks(m)
    elif m["first_tentative_s"] is None or m["first_tentative_s"] < m["transfer_residual_s"]:
        timing.less_than(f"{gbps:g} Gbit/s: the engine took the full cache, against the residual lane's completion",
                         m["full_taken_s"], m["transfer_residual_s"])
    else:
        step_s = m["first_tentative_s"] - m["draft_start_s"]
        timing.less_than(f"{gbps:g} Gbit/s: the residual landed during the first step; the engine took the full "
                         "cache, against the first tentative token plus one step",
                         m["full_taken_s"], m["first_tentative_s"] + step_s)
    timing.at_most(f"{gbps:g} Gbit/s: the residual lane's completion, against the first committed token",
                   m["transfer_residual_s"], m["ttfct_s"])


@pytest.fixture(scope="module")
def unshaped_runs(model, server, node) -> tuple[tuple[int, ...], list[tuple[dict, list[Event]]]]:
    """INT8's tokens and five LYNX runs of a short prompt over the unshaped loopback link, where
    the whole cache (~3 MB) lands in a few milliseconds: within the first step."""
    ids = model.tokenize(filler_prose(model.tokenize, 300, 108))
    int8 = node.run(server, ids, scheme=Scheme.INT8, max_new_tokens=8)
    runs = []
    for _ in range(5):
        events: list[Event] = []
        lynx = node.run(server, ids, scheme=Scheme.LYNX, max_new_tokens=8, on_event=events.append)
        assert lynx.tokens == int8.tokens
        runs.append((lynx.metrics, events))
    return int8.tokens, runs


def test_a_first_step_on_exact_kv_in_every_layer_is_final_at_once(model, unshaped_runs) -> None:
    """What the design guarantees: each layer of the first step read the finest level in when
    the step reached it; where that was the exact one in every layer, the first token came out
    committed, nothing was drafted or verified, and every region had landed before it; where
    some layer read its anchors only, the first token was tentative and a verify pass ran."""
    _, runs = unshaped_runs
    last = 1  # planes 4,4: level 0 the anchors, level 1 exact
    for m, events in runs:
        levels = m["first_pass_levels"]
        assert len(levels) == model.info.num_layers and set(levels) <= {0, last}, levels
        if m["first_token_committed"]:
            assert set(levels) == {last} and m["verify_passes"] == 0 and m["drafted"] == 0
            assert isinstance(events[0], Committed) and not any(isinstance(e, Tentative) for e in events)
            assert _landed_by(m, range(len(m["arrivals_s"]))) <= m["ttft_s"] == m["ttfct_s"]
        else:
            assert 0 in levels and m["verify_passes"] >= 1 and isinstance(events[0], Tentative)


@pytest.mark.timing
def test_on_an_unshaped_link_the_first_token_is_committed_without_a_verify_pass(unshaped_runs, timing) -> None:
    # the whole cache lands within the first step: every layer reads exact K/V, as INT8 would
    _, runs = unshaped_runs
    timing.at_least("unshaped link: LYNX runs whose first token was committed at once, of 5",
                    sum(m["first_token_committed"] for m, _ in runs), 3, unit="")


def test_prompt_beyond_context_is_refused_clearly(model, server, node) -> None:
    ids = [model.tokenize("hello")[0]] * (model.info.max_positions + 1)
    with pytest.raises(PromptError, match="context window of 8192"):
        node.run(server, ids, scheme=Scheme.LYNX, max_new_tokens=4)
    # Text is tokenized by the prefill node, which refuses it and says why.
    with pytest.raises(DecodeError, match="refused the request: .*context window"):
        node.run(server, "hello " * 9000, scheme=Scheme.LYNX, max_new_tokens=4)


@pytest.mark.parametrize("policy", [MissingFull.FAIL, MissingFull.UNVERIFIED])
def test_prefill_node_dying_mid_stream_never_commits_a_tentative_token(model, node, policy) -> None:
    ids = model.tokenize(filler_prose(model.tokenize, 2100, 107))
    events: list[Event] = []
    with serve_process() as (child, address):
        def on_event(event: Event) -> None:
            events.append(event)
            if isinstance(event, Tentative) and child.proc.poll() is None:
                os.kill(child.proc.pid, signal.SIGKILL)

        def run():
            return node.run(address, ids, scheme=Scheme.LYNX, max_new_tokens=8,
                            bandwidth_gbps=0.05, on_missing_residual=policy, on_event=on_event)

        if policy is MissingFull.FAIL:
            with pytest.raises(LynxError, match="full KV cache failed"):
                run()
        else:
            result = run()
            assert result.metrics["verified"] is False
            assert "failed" in result.metrics["unverified_reason"]
            assert len(result.tokens) == 8
            assert list(result.tokens) == [t for e in events if isinstance(e, Unverified)
                                           for t in e.tokens]
    assert any(isinstance(e, Tentative) for e in events)
    assert not any(isinstance(e, Committed) for e in events)
