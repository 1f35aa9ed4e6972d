"""`lynx load --planes W,W[,W]|auto`: auto is the default LYNX split, --anchor-bits B
keeps working (not with --planes), a bad split fails before anything starts, and
the orchestrator sends what auto chose (possibly no split: the LYNX phases then run
as INT8, and the config, the phases and the table say so). The decode nodes are a
fake that answers each job at once as a sink would (no processes, no sockets)."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lynx_bench import cli
from lynx_bench.common.processes import ChildError
from lynx_bench.load import cli as load_cli
from lynx_bench.load import phases as load_phases
from lynx_bench.load.logic import DecodeMode, LoadConfig, ModelShape, job_split, request_bytes
from lynx_bench.load.report import summary_table
from lynx_bench.load.results import summarize
from lynx_decode.codec.config import Scheme
from lynx_transport.errors import ConfigError

SMOLLM2 = ModelShape(layers=30, kv_heads=3, head_dim=64, vocab=49152, max_positions=8192)


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    load_cli.add_arguments(parser)
    return parser.parse_args(list(flags))


@pytest.mark.parametrize(("flags", "split"), [
    ((), "auto"),
    (("--planes", "auto"), "auto"),
    (("--planes", "4,4"), (4, 4)),
    (("--planes", "2,2,4"), (2, 2, 4)),
    (("--anchor-bits", "3"), (3, 5)),
])
def test_the_split_the_flags_ask_for(flags: tuple[str, ...], split: object) -> None:
    assert load_cli.config_from_args(_args(*flags)).split == split


def test_planes_and_anchor_bits_are_mutually_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _args("--planes", "4,4", "--anchor-bits", "3")
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(("planes", "message"), [
    ("3,4", "--planes: planes 3,4 sum to 7 bits"),
    ("7,1", "--planes: planes 7,1: the anchor"),
    ("four", "--planes: planes must be comma-separated"),
    ("8", "--planes: planes 8: a split needs at least 2 planes"),
])
def test_a_bad_split_fails_before_anything_starts(tmp_path: Path, planes: str, message: str,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def nothing(*_: object, **__: object) -> None:
        raise AssertionError("lynx load went on past a bad --planes")

    monkeypatch.setattr(load_cli, "default_model_shape", nothing)
    monkeypatch.setattr(load_cli, "run_load", nothing)
    with pytest.raises(ConfigError, match=message):
        load_cli.config_from_args(_args("--planes", planes))
    out = tmp_path / "o"
    assert cli.main(["load", "--planes", planes, "--out", str(out), "--no-progress"]) == 2
    assert f"lynx: error: {message}" in capsys.readouterr().err
    assert not out.exists()


# -- the orchestrator, over fake decode nodes ----------------------------------------------------

class _FakeNodes:
    """Answers every job at once, as a sink does: the scheme and split the job asks for
    (:func:`job_split`), that stream's bytes (``lynx_bytes``: LYNX's, when given, to
    play a node whose streams disagree with the model's shape)."""

    def __init__(self, context: int, lynx_bytes: tuple[int, int] | None = None) -> None:
        self.context = context
        self.lynx_bytes = lynx_bytes
        self.jobs: list[dict[str, Any]] = []
        self._answers: dict[str, dict[str, Any]] = {}

    def send(self, node: int, jobs: list[dict[str, Any]]) -> None:
        for job in jobs:
            self.jobs.append(job)
            scheme, planes = job_split(job)
            assert planes != "auto", "a sink job must carry the split auto chose"
            nbytes = request_bytes(SMOLLM2, scheme.value, self.context, planes)
            if scheme is Scheme.LYNX and self.lynx_bytes is not None:
                nbytes = self.lynx_bytes
            sent = float(job["send_unix"])
            self._answers[job["request_id"]] = {
                "request_id": job["request_id"], "status": "completed", "scheme": scheme.value,
                "planes": list(planes) if scheme is Scheme.LYNX else None,
                "sent_unix": sent, "scheduled_unix": sent, "anchor_unix": sent + 0.01,
                "full_unix": sent + 0.02, "bytes_anchor": nbytes[0], "bytes_residual": nbytes[1],
                "error": None}

    def gather(self, want: set[str], *_: object, **__: object) -> dict[str, dict[str, Any]]:
        return {rid: self._answers[rid] for rid in want}


def _fake_start(monkeypatch: pytest.MonkeyPatch, nodes: _FakeNodes) -> None:
    @contextlib.contextmanager
    def start(*_: object) -> Iterator[_FakeNodes]:
        yield nodes

    monkeypatch.setattr(load_cli, "start_nodes", start)


def _run(monkeypatch: pytest.MonkeyPatch, config: LoadConfig,
         lynx_bytes: tuple[int, int] | None = None) -> tuple[dict[str, Any], list, list, _FakeNodes]:
    nodes = _FakeNodes(config.context, lynx_bytes)
    _fake_start(monkeypatch, nodes)
    recorded, rows, phases = load_cli.run_load(config.validate(SMOLLM2.max_positions), SMOLLM2,
                                               progress=False)
    return recorded, rows, phases, nodes


def _config(tmp_path: Path, **changes: Any) -> LoadConfig:
    return LoadConfig(schemes=("int8", "lynx"), loads=(0.5,), requests=4, decode_nodes=2, prompts=2,
                      out=tmp_path / "out", **changes)


def test_auto_at_a_small_context_on_a_fast_link_runs_lynx_as_int8_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorded, rows, phases, nodes = _run(monkeypatch, _config(tmp_path, context=512,
                                                                       bandwidth_gbps=10.0))
    assert recorded["planes"] == "auto" and recorded["lynx_planes"] is None
    assert recorded["split_choice"].startswith("--planes auto chose int8 (no split): the INT8 cache takes")
    assert "the lynx phases run as INT8" in recorded["split_choice"]
    # the sink is asked for INT8, and its bytes are INT8's
    lynx_jobs = [j for j in nodes.jobs if j["scheme"] == "lynx"]
    assert lynx_jobs and all(j["planes"] is None for j in lynx_jobs)
    assert recorded["bytes_per_request"]["lynx"] == recorded["bytes_per_request"]["int8"]
    lynx = [r for r in rows if r.scheme == "lynx"]
    assert lynx and all(r.bytes_residual == 0 and r.ttft_s == r.time_to_full_s for r in lynx)
    assert [p["planes"] for p in phases] == [None, {"int8": 4}]
    assert recorded["warm_up"][-1] == {"node": 1, "scheme": "lynx", "prompt_id": 0, "status": "completed",
                                       "planes": "int8"}
    names = load_cli.scheme_names(phases, recorded["lynx_planes"])
    assert names == {"lynx": "lynx int8"}
    assert "lynx int8" in summary_table(summarize(rows, 10.0), names)
    json.dumps(recorded)


@pytest.mark.parametrize(("context", "gbps", "planes"), [(4096, 1.0, (4, 4)), (4096, 0.25, (3, 5))])
def test_auto_on_a_big_cache_or_a_slow_link_sends_the_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          context: int, gbps: float,
                                                          planes: tuple[int, ...]) -> None:
    recorded, rows, phases, nodes = _run(monkeypatch, _config(tmp_path, context=context,
                                                                       bandwidth_gbps=gbps))
    name = ",".join(map(str, planes))
    assert recorded["lynx_planes"] == list(planes)
    assert recorded["split_choice"].startswith(f"--planes auto chose lynx {name}: ")
    assert all(j["planes"] == list(planes) for j in nodes.jobs if j["scheme"] == "lynx")
    want = request_bytes(SMOLLM2, "lynx", context, planes)
    assert recorded["bytes_per_request"]["lynx"] == {"anchor": want[0], "residual": want[1]}
    assert all((r.bytes_anchor, r.bytes_residual) == want and r.ttft_s == r.time_to_anchor_s
               for r in rows if r.scheme == "lynx")
    assert phases[1]["planes"] == {name: 4}
    assert load_cli.scheme_names(phases, recorded["lynx_planes"]) == {"lynx": f"lynx {name}"}


def test_a_fixed_split_is_sent_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorded, _, phases, nodes = _run(monkeypatch, _config(tmp_path, context=512,
                                                                    bandwidth_gbps=10.0, planes=(4, 4)))
    assert recorded["lynx_planes"] == [4, 4] and recorded["split_choice"] == "lynx 4,4: asked for (--planes 4,4)"
    assert all(j["planes"] == [4, 4] for j in nodes.jobs)
    assert phases[1]["planes"] == {"4,4": 4}


def test_the_warm_up_checks_the_bytes_of_the_split_that_ran(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # a node whose LYNX streams carry 4,4's bytes while auto asked for 3,5
    wrong = request_bytes(SMOLLM2, "lynx", 4096, (4, 4))
    with pytest.raises(ChildError, match="its LYNX 3,5 stream carried"):
        _run(monkeypatch, _config(tmp_path, context=4096, bandwidth_gbps=0.25), lynx_bytes=wrong)


def test_with_the_model_auto_is_left_to_each_decode_node(tmp_path: Path) -> None:
    config = _config(tmp_path, context=512, bandwidth_gbps=10.0, decode=DecodeMode.MODEL)
    planes, note = load_cli.lynx_planes(config, sum(request_bytes(SMOLLM2, "int8", 512)))
    assert planes == "auto" and "chosen per request by each decode node" in note
    job = load_phases.job("r", "lynx", 0, 0.0, config, None, planes)
    assert job["planes"] == "auto" and job_split(job) == (Scheme.LYNX, "auto")
    assert load_cli.scheme_names([], planes) == {"lynx": "lynx auto"}
    # the pool holds the largest stream of any split auto may choose
    largest = max(sum(request_bytes(SMOLLM2, "lynx", 512, p)) for p in ((4, 4), (3, 5)))
    assert load_cli._pool_bytes(config, SMOLLM2, planes) >= 2 * largest


def test_lynx_load_prints_what_auto_chose(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    nodes = _FakeNodes(512)
    _fake_start(monkeypatch, nodes)
    monkeypatch.setattr(load_cli, "default_model_shape", lambda: SMOLLM2)
    out = tmp_path / "o"
    rc = cli.main(["load", "--schemes", "int8,lynx", "--context", "512", "--bandwidth", "10",
                   "--load", "0.5", "--requests", "3", "--decode-nodes", "1", "--prompts", "1",
                   "--out", str(out), "--no-progress"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "lynx int8" in stdout
    assert "lynx: --planes auto chose int8 (no split)" in stdout
    config = json.loads((out / "load.json").read_text())["config"]
    assert config["lynx_planes"] is None and "int8 (no split)" in config["split_choice"]
