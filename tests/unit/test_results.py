"""Sweep results keep their fixed columns through JSON and CSV, the tables show both
clocks for every LYNX split, and the plots render."""

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from lynx_bench.sweep.plots import plot_accuracy, plot_ttft_vs_bandwidth, scheme_colors
from lynx_bench.sweep.results import (
    COLUMNS,
    Row,
    first_token_correct,
    means,
    order_schemes,
    ratio_table,
    read_results,
    summary_table,
    ttft_ratios,
    write_results,
)

#: scheme -> (planes, ttft base, ttfct extra over ttft, e2e extra over ttft)
SCHEMES: dict[str, tuple[str | None, float, float, float]] = {
    "bf16": (None, 4.0, 0.0, 1.0),
    "int8": (None, 2.0, 0.0, 1.0),
    "int4": (None, 1.0, 0.0, 1.0),
    "lynx": ("4,4", 1.05, 0.2, 0.9),
}


def _rows(schemes: dict[str, tuple[str | None, float, float, float]] = SCHEMES) -> list[Row]:
    rows = []
    for scheme, (planes, base, late, last) in schemes.items():
        lynx = planes is not None
        for bw in (1.0, 10.0):
            for repeat in range(2):
                ttft = base / bw + 0.01 * repeat
                rows.append(Row(scheme, planes, bw, 1024, 0, repeat, ttft, ttft + late, ttft + last,
                                (0.0 if repeat else 1.0) if lynx else None, 0.8 if lynx else None,
                                100, 50, 150, 1.0, 1.0, None, "the key is 12345"))
    return rows


#: a sweep of three splits: the baselines, then lynx-4, lynx-3, lynx-2.2.4
SPLITS = {k: v for k, v in SCHEMES.items() if k != "lynx"} | {
    "lynx-4": ("4,4", 1.05, 0.2, 0.9), "lynx-3": ("3,5", 0.9, 0.4, 0.95), "lynx-2.2.4": ("2,2,4", 0.8, 0.3, 0.8)}


def test_columns_are_the_documented_fixed_set() -> None:
    assert COLUMNS == (
        "scheme", "planes", "bandwidth_gbps", "context", "prompt_id", "repeat", "ttft_s", "ttfct_s", "e2e_s",
        "first_token_correct", "acceptance_rate", "bytes_anchor", "bytes_residual", "bytes_total", "accuracy",
        "agreement_vs_int8", "agreement_vs_bf16", "text", "physical_limit_s", "first_byte_s", "held_bytes",
    )


def test_json_and_csv_round_trip(tmp_path: Path) -> None:
    rows = _rows(SPLITS)
    json_path, csv_path = write_results(tmp_path, {"seed": 1, "command": "lynx sweep"}, rows)
    config, back = read_results(json_path)
    assert config == {"seed": 1, "command": "lynx sweep"}
    assert back == rows
    with csv_path.open() as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames or ()) == COLUMNS
        got = list(reader)
    assert len(got) == len(rows)
    assert {r["planes"] for r in got} == {"", "4,4", "3,5", "2,2,4"}
    assert {r["first_token_correct"] for r in got if r["scheme"] == "int8"} == {""}
    assert {r["first_token_correct"] for r in got if r["scheme"] == "lynx-3"} == {"1.0", "0.0"}
    assert all(float(r["ttfct_s"]) >= float(r["ttft_s"]) for r in got)


def test_read_rejects_rows_with_other_columns(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"config": {}, "rows": [{"scheme": "lynx"}]}))
    with pytest.raises(ValueError, match="columns"):
        read_results(path)


def test_table_has_a_line_per_scheme_and_bandwidth() -> None:
    table = summary_table(_rows())
    assert len(table.splitlines()) == 2 + 8
    header = table.splitlines()[0].split()
    assert header[header.index("ttft_s") + 1] == "ttfct_s"
    assert "first_ok" in header
    lynx = [line.split() for line in table.splitlines() if " lynx " in line]
    assert len(lynx) == 2 and all(line[header.index("first_ok")] == "0.50" for line in lynx)
    int8 = [line.split() for line in table.splitlines() if " int8 " in line]
    assert all(line[header.index("first_ok")] == "-" for line in int8)


def test_table_with_several_splits_orders_baselines_then_splits() -> None:
    table = summary_table(_rows(SPLITS))
    lines = table.splitlines()
    assert len(lines) == 2 + 2 * 6
    at_1 = [line.split()[2] for line in lines[2:] if line.split()[0] == "1"]
    assert at_1 == ["bf16", "int8", "int4", "lynx-4", "lynx-3", "lynx-2.2.4"]
    header = lines[0].split()
    lynx3 = next(line.split() for line in lines if line.split()[:3] == ["1", "1024", "lynx-3"])
    assert float(lynx3[header.index("ttft_s")]) == pytest.approx(0.905, abs=1e-3)
    assert float(lynx3[header.index("ttfct_s")]) == pytest.approx(1.305, abs=1e-3)
    assert len({len(line) for line in lines[2:]}) == 1  # fixed width with the long names too


def test_plots_render_png(tmp_path: Path) -> None:
    for rows in (_rows(), _rows(SPLITS)):
        for fn, name in ((plot_ttft_vs_bandwidth, "ttft.png"), (plot_accuracy, "acc.png")):
            path = fn(rows, tmp_path / name)
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert path.stat().st_size > 10_000


def test_ttft_plot_draws_committed_beside_tentative_for_each_split(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot_ttft_vs_bandwidth(_rows(SPLITS), tmp_path / "ttft.png")
    (ax,) = figures[0].axes
    lines = {bars.get_label(): bars.lines[0] for bars in ax.containers}  # errorbar: (data line, caps, bars)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["bf16 ttft_s", "int8 ttft_s", "int4 ttft_s",
                      "lynx-4 ttft_s (tentative)", "lynx-4 ttfct_s (committed)",
                      "lynx-3 ttft_s (tentative)", "lynx-3 ttfct_s (committed)",
                      "lynx-2.2.4 ttft_s (tentative)", "lynx-2.2.4 ttfct_s (committed)"]
    for split in ("lynx-4", "lynx-3", "lynx-2.2.4"):
        tentative, committed = lines[f"{split} ttft_s (tentative)"], lines[f"{split} ttfct_s (committed)"]
        assert tentative.get_linestyle() == "-" and committed.get_linestyle() == "--"
        assert tentative.get_color() == committed.get_color()
        assert list(committed.get_ydata()) > list(tentative.get_ydata())
    plt.close(figures[0])
    colors = scheme_colors(order_schemes(["lynx-3", "int8", "lynx-4"]))
    assert colors["int8"] == scheme_colors(["int8"])["int8"]
    assert len({colors["lynx-3"], colors["lynx-4"], colors["int8"]}) == 3


def test_ttft_ratios_against_baselines() -> None:
    ratios = {(r["bandwidth_gbps"], r["context"], r["scheme"]): r for r in ttft_ratios(_rows())}
    assert set(ratios) == {(1.0, 1024, "lynx"), (10.0, 1024, "lynx")}
    one = ratios[(1.0, 1024, "lynx")]
    assert one["ttft_over_int8"] == pytest.approx(1.055 / 2.005)
    assert one["ttft_over_int4"] == pytest.approx(1.055 / 1.005)
    assert one["ttfct_over_int8"] == pytest.approx(1.255 / 2.005)
    assert one["e2e_over_int8"] == pytest.approx(1.955 / 3.005)
    assert one["first_token_correct"] == 0.5
    assert one["equal_to_int8"] == 1.0


def test_ratio_table_has_a_line_per_split_and_names_the_clocks() -> None:
    rows = _rows(SPLITS)
    ratios = ttft_ratios(rows)
    assert [(r["bandwidth_gbps"], r["scheme"]) for r in ratios] == [
        (bw, s) for bw in (1.0, 10.0) for s in ("lynx-4", "lynx-3", "lynx-2.2.4")]
    lynx3 = next(r for r in ratios if r["scheme"] == "lynx-3" and r["bandwidth_gbps"] == 1.0)
    assert lynx3["ttfct_over_int8"] == pytest.approx(1.305 / 2.005)
    table = ratio_table(rows).splitlines()
    clocks, header = table[0].split(), table[1].split()
    assert clocks == ["lynx", "clock:", "tentative", "tentative", "committed", "last", "tentative"]
    assert header == ["Gbit/s", "context", "scheme", "ttft/int8.ttft", "ttft/int4.ttft", "ttfct/int8.ttft",
                      "e2e/int8.e2e", "ttft/limit", "first_ok", "=int8"]
    assert len(table) == 3 + 6
    line = next(line.split() for line in table if line.split()[:3] == ["1", "1024", "lynx-3"])
    assert line[3:] == [f"{0.905 / 2.005:.2f}", f"{0.905 / 1.005:.2f}", f"{1.305 / 2.005:.2f}",
                        f"{1.855 / 3.005:.2f}", "-", "0.50", "1.00"]  # no physical limit in these rows


def test_ratios_without_baselines_are_missing_not_zero() -> None:
    rows = [r for r in _rows(SPLITS) if r.scheme.startswith("lynx")]
    for r in ttft_ratios(rows):
        assert r["ttft_over_int8"] is None and r["ttft_over_int4"] is None and r["e2e_over_int8"] is None
    assert " - " in ratio_table(rows)


def test_first_token_correct() -> None:
    assert first_token_correct("lynx", 5, [5, 6]) == 1.0
    assert first_token_correct("lynx", 4, [5, 6]) == 0.0
    assert first_token_correct("lynx", None, [5, 6]) == 1.0  # nothing drafted: the first token shown was committed
    assert first_token_correct("lynx", 5, [5], verified=False) is None
    assert first_token_correct("lynx", 5, []) is None
    for scheme in ("int8", "int4", "bf16"):
        assert first_token_correct(scheme, None, [5, 6]) is None


def test_means_are_fractions_for_zero_one_fields() -> None:
    got = means(_rows(SPLITS), "first_token_correct")
    assert got[("lynx-3", 1.0, 1024)] == 0.5
    assert ("int8", 1.0, 1024) not in got


def test_physical_limit_is_anchor_bytes_at_the_link_rate_plus_a_layer_and_the_head() -> None:
    from lynx_bench.sweep.worker import physical_limit

    m = {"step_s": 0.1, "bytes_anchor": 125_000_000}
    # decode steps of 0.1 s; 30 layers; a head of 10 ms: 1 s of bytes + 3 ms + 10 ms
    assert physical_limit(m, 1.0, 0.010, 30) == pytest.approx(1.0 + 0.090 / 30 + 0.010)
    assert physical_limit(m, None, 0.010, 30) is None
    assert physical_limit({**m, "step_s": None}, 1.0, 0.010, 30) is None


def test_crossover_lines_say_what_the_sweep_shows() -> None:
    from lynx_bench.sweep.results import crossover_lines

    lines = crossover_lines(_rows(SPLITS))
    assert len(lines) == 3
    assert lines[0].startswith("1024 tokens, lynx-2.2.4: the first (tentative) token comes ")
    assert " at 1 Gbit/s, " in lines[0] and " at 10 Gbit/s than INT8's first token does" in lines[0]
    assert "the first committed token at " in lines[0]
    assert crossover_lines([r for r in _rows(SPLITS) if r.scheme.startswith("lynx")]) == []
