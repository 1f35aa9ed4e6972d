"""`lynx generate --stream --timeline` as a user runs it: a real ``lynx serve`` process,
a real ``lynx generate`` process (the real model, UCX, the link held to 0.1 Gbit/s
so the residual is still landing while the decode node drafts), its stdout a pipe.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lynx_bench.accuracy.workload import filler_prose
from lynx_bench.nodes.timeline import timeline_figure

from .nodes import serve_process

pytestmark = [pytest.mark.model, pytest.mark.ucx]


def test_a_streamed_run_with_its_timeline(tmp_path: Path) -> None:
    from lynx_decode.model import HFCausalLM

    model = HFCausalLM.load()
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(filler_prose(model.tokenize, 2000, 7))
    png, out_json = tmp_path / "run.png", tmp_path / "run.json"
    with serve_process() as (_child, (host, port)):
        proc = subprocess.run(
            [sys.executable, "-m", "lynx_bench.cli", "generate", "--connect", f"{host}:{port}",
             "--prompt-file", str(prompt), "--scheme", "lynx", "--bandwidth", "0.1", "--max-new-tokens", "16",
             "--stream", "--timeline", str(png), "--json", str(out_json)],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out_json.read_text())
    # a pipe: the committed text as it came, no escape codes, then the closing line
    assert "\x1b" not in proc.stdout
    text, closing = proc.stdout.rstrip("\n").rsplit("\n", 1)
    assert text == run["text"]
    # no split asked for: auto chose one for 0.1 Gbit/s (a cache of many decode steps), and the
    # closing line names the split that ran
    assert run["split_choice"] and run["planes"] in ([4, 4], [3, 5]), run["split_choice"]
    name = "lynx" if run["planes"] == [4, 4] else "lynx-3"
    assert closing.startswith(f"{name}: ttft_s=") and "acceptance=" in closing
    # every region of both planes landed, at times on the run's clock
    layers = model.info.num_layers
    assert [len(times) for times in run["arrivals_s"]] == [layers, layers]
    assert layers * run["region_bytes"][1] == run["bytes_residual"]
    assert 0 <= layers * run["region_bytes"][0] <= run["bytes_anchor"]  # (+ the prompt's token ids)
    assert max(run["arrivals_s"][0]) <= run["transfer_anchor_s"] + 1e-6
    assert min(run["arrivals_s"][1]) == pytest.approx(run["first_residual_s"])
    assert max(run["arrivals_s"][1]) <= run["transfer_residual_s"] + 1e-6
    assert run["draft_start_s"] is not None and 0 <= run["draft_start_s"] < run["ttft_s"]
    # the token events: seen at or after the engine's own clocks, committed = the output
    events = run["token_events"]
    first_tentative = next(e for e in events if e["kind"] == "tentative")
    assert first_tentative["t_s"] >= run["ttft_s"] - 1e-6
    first_committed = next(e for e in events if e["kind"] == "committed")
    assert first_committed["t_s"] >= run["ttfct_s"] - 1e-6
    committed = [t for e in events if e["kind"] == "committed" for t in e["tokens"]]
    assert committed == run["tokens"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    top, bottom = timeline_figure(run).axes
    assert len([line for line in top.get_lines() if "plane" in str(line.get_label())]) == 2
    assert bottom.get_xlim()[1] >= run["e2e_s"]
