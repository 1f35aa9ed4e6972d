"""Sweep results keep their fixed columns through JSON and CSV, and the plots render."""

import csv
import json
from pathlib import Path

import pytest

from lynx_bench.plots import plot_accuracy, plot_ttft_vs_bandwidth
from lynx_bench.results import COLUMNS, Row, ratio_table, read_results, summary_table, ttft_ratios, write_results


def _rows() -> list[Row]:
    rows = []
    for scheme, base in (("bf16", 4.0), ("int8", 2.0), ("int4", 1.0), ("lynx", 1.05)):
        for bw in (1.0, 10.0):
            for repeat in range(2):
                rows.append(Row(scheme, bw, 1024, 0, repeat, base / bw + 0.01 * repeat, base / bw + 0.2,
                                base / bw + 1.0, 0.8 if scheme == "lynx" else None, 100, 50, 150,
                                1.0, 1.0, None, "the key is 12345"))
    return rows


def test_columns_are_the_documented_fixed_set() -> None:
    assert COLUMNS == (
        "scheme", "bandwidth_gbps", "context", "prompt_id", "repeat", "ttft_s", "ttfct_s", "e2e_s",
        "acceptance_rate", "bytes_anchor", "bytes_residual", "bytes_total", "accuracy",
        "agreement_vs_int8", "agreement_vs_bf16", "text",
    )


def test_json_and_csv_round_trip(tmp_path: Path) -> None:
    rows = _rows()
    json_path, csv_path = write_results(tmp_path, {"seed": 1, "command": "lynx sweep"}, rows)
    config, back = read_results(json_path)
    assert config == {"seed": 1, "command": "lynx sweep"}
    assert back == rows
    with csv_path.open() as fh:
        reader = csv.reader(fh)
        assert tuple(next(reader)) == COLUMNS
        assert sum(1 for _ in reader) == len(rows)


def test_read_rejects_rows_with_other_columns(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"config": {}, "rows": [{"scheme": "lynx"}]}))
    with pytest.raises(ValueError, match="columns"):
        read_results(path)


def test_table_has_a_line_per_scheme_and_bandwidth() -> None:
    table = summary_table(_rows())
    assert len(table.splitlines()) == 2 + 8
    assert "lynx" in table and "ttft_s" in table


def test_plots_render_png(tmp_path: Path) -> None:
    for fn, name in ((plot_ttft_vs_bandwidth, "ttft.png"), (plot_accuracy, "acc.png")):
        path = fn(_rows(), tmp_path / name)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 10_000


def test_ttft_ratios_against_baselines() -> None:
    ratios = {(r["bandwidth_gbps"], r["context"]): r for r in ttft_ratios(_rows())}
    one = ratios[(1.0, 1024)]
    assert one["int8_over_lynx"] == pytest.approx(2.005 / 1.055)
    assert one["lynx_over_int4"] == pytest.approx(1.055 / 1.005)
    assert one["lynx_equal_to_int8"] == 1.0
    assert "int8/lynx" in ratio_table(_rows())
