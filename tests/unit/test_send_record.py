"""The prefill node's send records: the JSON-lines file and its readers (virtual clock)."""

from __future__ import annotations

from pathlib import Path

from lynx_bench.load.results import send_record_summary
from lynx_decode.send_record import RecordsFile, SendRecord, read_records, wait_record


def _record(rid: str, scheme: str = "int8", first: float | None = 0.002, held: int = 100) -> SendRecord:
    return SendRecord(rid, scheme, (4, 4) if scheme == "lynx" else None, 1.0e9, 0.5, 0.001, first, 0.1,
                      80, 20 if scheme == "lynx" else 0, held)


def test_records_are_read_back_by_request_id_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    records = RecordsFile(path)
    records(_record("a"))
    records(_record("b", "lynx"))
    records.close()
    records(_record("late"))  # after close: dropped, not an error
    with path.open("a") as fh:
        fh.write('{"request_id": "c", "sch')  # a line still being written
    got = read_records(path)
    assert set(got) == {"a", "b"}
    assert got["b"]["planes"] == [4, 4] and got["a"]["planes"] is None
    assert read_records(tmp_path / "missing.jsonl") == {}


def test_wait_record_waits_for_the_record_and_gives_up_at_its_timeout(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    now = [0.0]
    records = RecordsFile(path)

    def sleep(s: float) -> None:
        now[0] += s
        if now[0] >= 0.1:
            records(_record("x"))

    got = wait_record(path, "x", 1.0, clock=lambda: now[0], sleep=sleep)
    assert got is not None and got["request_id"] == "x" and 0.1 <= now[0] < 0.2
    now[0] = 0.0
    assert wait_record(path, "never", 0.5, clock=lambda: now[0], sleep=sleep) is None
    assert now[0] >= 0.5
    records.close()


def test_the_load_summary_gives_first_byte_percentiles_and_bytes_held_per_scheme() -> None:
    rows = [_record(str(i), "lynx" if i % 2 else "int8", first=i / 1000, held=100 * i).to_json()
            for i in range(1, 7)]
    rows.append(_record("none", "int8", first=None).to_json())
    out = send_record_summary(rows)
    assert set(out) == {"int8", "lynx"}
    assert out["int8"]["requests"] == 4 and out["int8"]["first_byte_p50_s"] == 0.004
    assert out["lynx"]["first_byte_p50_s"] == 0.003 and out["lynx"]["held_bytes_p50"] == 300
