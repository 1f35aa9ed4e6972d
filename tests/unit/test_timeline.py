"""`lynx generate --timeline`: the figure built from a run's ``--json`` dict, checked
through its artists (line data, spans, labels, x range), and the PNG the CLI writes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from lynx_bench.nodes.timeline import timeline_figure, token_events, write_timeline
from lynx_decode.events import Committed, DecodeMetrics, Done, Rollback, Tentative, Unverified
from tests.unit.test_generate_stream import REPO, _child

MB = 1_000_000


def _lynx_run() -> dict[str, Any]:
    return {
        "scheme": "lynx", "planes": [4, 4], "prompt_tokens": 2000,
        "arrivals_s": [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], "region_bytes": [2 * MB, MB],
        "draft_start_s": 0.05, "ttft_s": 0.35, "full_taken_s": 0.62, "verify_s": 0.08,
        "ttfct_s": 0.71, "e2e_s": 1.0, "draft_ready_s": 0.31, "full_ready_s": 0.61,
        "token_events": [
            {"t_s": 0.36, "kind": "tentative", "position": 0, "tokens": [7]},
            {"t_s": 0.45, "kind": "tentative", "position": 1, "tokens": [8]},
            {"t_s": 0.55, "kind": "tentative", "position": 2, "tokens": [9]},
            {"t_s": 0.70, "kind": "rollback", "position": 1, "n_rejected": 2},
            {"t_s": 0.71, "kind": "committed", "position": 0, "tokens": [7, 5]},
            {"t_s": 0.85, "kind": "committed", "position": 2, "tokens": [6]},
        ],
    }


def _lines(ax: Axes) -> dict[str, Line2D]:
    return {line.get_label(): line for line in ax.get_lines()}


def _spans(ax: Axes) -> dict[str, tuple[float, float]]:
    """The shaded spans (axvspan: rectangles in data x), label -> (start, end), to 1 µs."""
    out = {}
    for patch in ax.patches:
        assert isinstance(patch, Rectangle)
        out[patch.get_label()] = (round(patch.get_x(), 6), round(patch.get_x() + patch.get_width(), 6))
    return out


def test_bytes_landed_per_lane_are_step_lines_on_the_shared_time_axis() -> None:
    fig = timeline_figure(_lynx_run(), title="lynx: 2000 prompt tokens, 1 Gbit/s")
    top, bottom = fig.axes
    assert top.get_shared_x_axes().joined(top, bottom)
    lines = _lines(top)
    anchor, residual = lines["anchor (plane 0, 4 bit)"], lines["residual plane 1 (4 bit)"]
    assert anchor.get_drawstyle() == "steps-post"
    assert list(anchor.get_xdata()) == [0.0, 0.1, 0.2, 0.3]
    assert list(anchor.get_ydata()) == [0, 2, 4, 6]  # MB: three regions of 2 MB
    assert list(residual.get_xdata()) == [0.0, 0.4, 0.5, 0.6] and list(residual.get_ydata()) == [0, 1, 2, 3]
    assert top.get_ylabel() == "bytes landed per lane (MB)"
    ready = {k: v for k, v in lines.items() if "complete" in k}
    assert [line.get_xdata()[0] for line in ready.values()] == [0.31, 0.61]
    assert top.get_title() == "lynx: 2000 prompt tokens, 1 Gbit/s"


def test_the_engine_phases_and_every_token_event_sit_at_their_times() -> None:
    bottom = timeline_figure(_lynx_run()).axes[1]
    spans = _spans(bottom)
    assert spans == {"first step": (0.05, 0.35), "drafting": (0.35, 0.62),
                     "verify pass": (0.62, 0.70), "decoding (exact cache)": (0.71, 1.0)}
    lines = _lines(bottom)
    tentative, withdrawn, committed = (lines[f"{k} token"] for k in ("tentative", "withdrawn", "committed"))
    assert list(tentative.get_xdata()) == [0.36, 0.45, 0.55] and list(tentative.get_ydata()) == [0, 1, 2]
    assert list(withdrawn.get_xdata()) == [0.70, 0.70] and list(withdrawn.get_ydata()) == [1, 2]
    assert list(committed.get_xdata()) == [0.71, 0.71, 0.85] and list(committed.get_ydata()) == [0, 1, 2]
    assert tentative.get_linestyle() == "None" and tentative.get_markerfacecolor() == "none"
    assert lines["ttft_s 0.350"].get_xdata()[0] == 0.35 and lines["ttfct_s 0.710"].get_xdata()[0] == 0.71
    left, right = bottom.get_xlim()
    assert left <= 0.0 and 1.0 <= right < 1.1
    assert bottom.get_xlabel().startswith("seconds from t0")


def test_a_one_lane_run_and_an_unverified_run() -> None:
    int8 = {"scheme": "int8", "planes": None, "prompt_tokens": 10, "arrivals_s": [[0.2, 0.4]],
            "region_bytes": [1000], "draft_start_s": None, "full_taken_s": 0.01, "ttft_s": 0.45,
            "ttfct_s": 0.45, "e2e_s": 0.6, "verify_s": None, "draft_ready_s": None, "full_ready_s": 0.41,
            "token_events": [{"t_s": 0.45, "kind": "committed", "position": 0, "tokens": [1]}]}
    top, bottom = timeline_figure(int8).axes
    assert [k for k in _lines(top) if "complete" not in k] == ["int8 (one lane)"]
    assert top.get_ylabel() == "bytes landed per lane (kB)"
    assert _spans(bottom) == {"first step": (0.01, 0.45), "decoding (exact cache)": (0.45, 0.6)}
    lost = {**_lynx_run(), "ttfct_s": None, "full_taken_s": 0.6, "verify_s": None, "full_ready_s": None,
            "token_events": [{"t_s": 0.36, "kind": "tentative", "position": 0, "tokens": [7]},
                             {"t_s": 0.9, "kind": "unverified", "position": 0, "tokens": [7, 8, 9]}]}
    bottom = timeline_figure(lost).axes[1]
    assert set(_spans(bottom)) == {"first step", "decoding (anchors only)"}
    assert list(_lines(bottom)["unverified token"].get_ydata()) == [0, 1, 2]
    assert not any(k.startswith("ttfct_s") for k in _lines(bottom))


def test_token_events_count_from_t0_and_leave_done_out() -> None:
    metrics = DecodeMetrics(0.1, 0.2, 0.3, 1.0, 1, 1, 1, True, 0.0, 0.1, 0.01, False)
    timed = [(100.5, Tentative(3, 0)), (100.6, Rollback(0, 1)), (100.7, Committed((4,), 0)),
             (100.8, Unverified((5,), 1)), (100.9, Done(metrics, (4, 5)))]
    got = token_events(timed, 100.0)
    assert [(e["kind"], e["position"]) for e in got] == [("tentative", 0), ("rollback", 0), ("committed", 0),
                                                          ("unverified", 1)]
    assert [e["t_s"] for e in got] == pytest.approx([0.5, 0.6, 0.7, 0.8])
    assert got[1]["n_rejected"] == 1 and got[2]["tokens"] == [4]
    json.dumps(got)


def test_write_timeline_writes_a_png(tmp_path: Path) -> None:
    path = write_timeline(tmp_path / "t.png", _lynx_run())
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cli_draws_the_run_it_made(tmp_path: Path) -> None:
    png = tmp_path / "run.png"
    proc = subprocess.run(_child(tmp_path, "--timeline", str(png)), stdin=subprocess.DEVNULL,
                          capture_output=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run = json.loads((tmp_path / "o.json").read_text())
    assert len(run["arrivals_s"]) == 2 == len(run["region_bytes"])  # the default split: two planes
    assert all(len(times) == 1 for times in run["arrivals_s"])  # the toy model has one layer
    assert run["t0_unix"] > 0 and run["token_events"]
    top, bottom = timeline_figure(run).axes
    assert len(top.get_lines()) >= 2 and bottom.get_xlim()[1] >= run["e2e_s"]
