"""The accuracy report's pure parts: texts, retrieval prompts, the config's checks,
each scheme's cache through the codec, the summary and its JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from lynx_bench.accuracy.config import AccuracyConfig, Workload, parse_workloads
from lynx_bench.accuracy.plots import _split_of, plot_accuracy_report, ttft_points
from lynx_bench.accuracy.report import (
    ROW_FIELDS,
    SUMMARY_FIELDS,
    AccuracyRow,
    check_corpus,
    lynx_mismatches,
    read_report,
    summarize,
    summary_table,
    write_report,
)
from lynx_bench.accuracy.retrieval import Retrieval, retrieval_cases
from lynx_bench.accuracy.schemes import scheme_cache
from lynx_bench.accuracy.texts import FALLBACK, Corpus, load_corpus, text_windows
from lynx_bench.sweep.config import SweepScheme
from lynx_bench.sweep.results import Row
from lynx_transport.errors import ConfigError


def chars(text: str) -> list[int]:
    """A tokenizer: one token per character."""
    return [ord(c) for c in text]


def detok(ids) -> str:
    return "".join(chr(i) for i in ids)


CORPUS = Corpus({"a": tuple(range(1000, 1600)), "b": tuple(range(2000, 2300))}, "texts")


def test_text_windows_are_seeded_slices_of_the_long_enough_documents() -> None:
    windows = text_windows(CORPUS, 150, 100, 4, seed=3)
    assert [w.document for w in windows] == ["a", "b", "a", "b"]
    for w in windows:
        doc = CORPUS.documents[w.document]
        assert len(w.ids) == 250 and w.ids == doc[w.offset : w.offset + 250]
    assert windows == text_windows(CORPUS, 150, 100, 4, seed=3)
    assert windows != text_windows(CORPUS, 150, 100, 4, seed=4)
    assert {w.document for w in text_windows(CORPUS, 400, 100, 3, seed=0)} == {"a"}  # b is too short
    with pytest.raises(ConfigError, match="longer than every text available.*600 tokens"):
        text_windows(CORPUS, 550, 100, 1, seed=0)


def test_corpus_reads_the_texts_on_the_machine_and_falls_back_to_prose(tmp_path: Path) -> None:
    (tmp_path / "MINE").write_text("hello world", encoding="utf-8")
    corpus = load_corpus(chars, ("MINE", "MISSING"), folder=tmp_path)
    assert corpus.source == "texts" and corpus.documents == {"MINE": tuple(chars("hello world"))}
    fallback = load_corpus(chars, ("MISSING",), folder=tmp_path, fallback_tokens=500)
    assert fallback.source == FALLBACK and 490 <= fallback.longest <= 500
    assert fallback == load_corpus(chars, ("MISSING",), folder=tmp_path, fallback_tokens=500)


def test_the_pydoc_text_is_always_there() -> None:
    corpus = load_corpus(lambda s: s.split(), ("pydoc",))
    assert corpus.source == "texts" and corpus.longest > 50_000


def test_retrieval_prompts_are_exactly_the_context_and_hide_their_answers() -> None:
    corpus = Corpus({"t": tuple(chars("lorem ipsum dolor sit amet. " * 200))}, "texts")
    cases = retrieval_cases(chars, corpus, 1500, 6, seed=1)
    assert [c.kind for c in cases] == [*Retrieval, *Retrieval]
    for case in cases:
        text = detok(case.prompt)
        assert len(case.prompt) == 1500
        assert all(text.count(v) >= 1 for v in case.values)
        assert detok(case.answer_ids).strip().rstrip(".").replace(" and", ",").split(", ") == list(case.values)
        assert list(case.depths) == sorted(case.depths)
    assert len(cases[1].values[0]) == 10 and len(cases[2].values) == 3
    assert cases == retrieval_cases(chars, corpus, 1500, 6, seed=1)
    with pytest.raises(ConfigError, match="too short"):
        retrieval_cases(chars, corpus, 200, 1, seed=1)


def test_parse_workloads_names_the_unknown_one() -> None:
    assert parse_workloads("fidelity, retrieval") == (Workload.FIDELITY, Workload.RETRIEVAL)
    with pytest.raises(ConfigError, match="unknown workload 'speed'; choose from fidelity, generation, retrieval"):
        parse_workloads("fidelity,speed")


@pytest.mark.parametrize(("changes", "match"), [
    ({"workloads": ()}, "at least one workload"),
    ({"workloads": (Workload.FIDELITY, Workload.FIDELITY)}, "listed twice"),
    ({"cases": 0}, "--cases: must be a positive integer, got 0"),
    ({"fidelity_tokens": -1}, "--fidelity-tokens"),
    ({"contexts": (32,)}, "too short"),
    ({"contexts": (8100,)}, "exceeds the model's context window of 8192"),
    ({"schemes": ("int8", "fp8")}, "unknown scheme 'fp8'"),
    ({"schemes": ("int8",), "anchor_bits": (3,)}, "lynx is not among --schemes"),
    ({"anchor_bits": (9,)}, "anchor bits must be in"),
])
def test_config_refuses_bad_input(tmp_path: Path, changes: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        AccuracyConfig(out=tmp_path, **changes).validate(max_context=8192)


def test_config_names_each_split_and_sizes_the_windows(tmp_path: Path) -> None:
    config = AccuracyConfig(out=tmp_path, anchor_bits=(4, 3)).validate(max_context=8192)
    assert [s.name for s in config.sweep_schemes] == ["bf16", "int8", "int4", "lynx-4", "lynx-3"]
    assert config.continuation == 256
    assert AccuracyConfig(workloads=(Workload.GENERATION,)).continuation == 64
    assert AccuracyConfig(workloads=(Workload.RETRIEVAL,)).continuation == 0
    assert [s.name for s in AccuracyConfig().sweep_schemes] == ["bf16", "int8", "int4", "lynx"]
    # 8192 - 256 fits the window; the texts decide the rest
    config = AccuracyConfig(out=tmp_path, contexts=(8192 - 256,), workloads=(Workload.FIDELITY,))
    config.validate(max_context=8192)
    with pytest.raises(ConfigError, match="longer than every text"):
        check_corpus(config, CORPUS)


def test_scheme_caches_go_through_the_codec_and_lynx_is_checked_against_int8() -> None:
    rng = np.random.default_rng(0)
    ref = [(rng.standard_normal((3, 130, 64)).astype(np.float32),
            rng.standard_normal((3, 130, 64)).astype(np.float32)) for _ in range(2)]
    int8 = scheme_cache(ref, SweepScheme("int8", "int8"))
    lynx = scheme_cache(ref, SweepScheme("lynx", "lynx", (4, 4)), int8.layers)
    assert lynx.equal_to_int8 is True and int8.equal_to_int8 is None and int8.draft is None
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(lynx.layers, int8.layers))
    assert lynx.draft is not None and not np.array_equal(lynx.draft[0][0], lynx.layers[0][0])
    three = scheme_cache(ref, SweepScheme("lynx-2.2.4", "lynx", (2, 2, 4)))
    assert three.equal_to_int8 is True
    err = {name: float(np.abs(scheme_cache(ref, SweepScheme(name, name)).layers[0][0] - ref[0][0]).mean())
           for name in ("bf16", "int8", "int4")}
    assert err["bf16"] < err["int8"] < err["int4"]
    draft_err = float(np.abs(lynx.draft[0][0] - ref[0][0]).mean())
    assert err["int8"] < draft_err
    # a LYNX split compared with a different cache is reported unequal, not trusted
    assert scheme_cache(ref, SweepScheme("lynx", "lynx", (4, 4)),
                        scheme_cache(ref, SweepScheme("int4", "int4")).layers).equal_to_int8 is False


def _rows() -> list[AccuracyRow]:
    rows = []
    for case, (b, i8, i4) in enumerate([(1.0, 1.0, 0.0), (1.0, 1.0, 1.0), (1.0, 0.0, 0.0)]):
        for scheme, v in (("bf16", b), ("int8", i8), ("int4", i4), ("lynx", i8)):
            rows.append(AccuracyRow("generation", 2048, scheme, case, "full_match_vs_bf16", v))
        rows.append(AccuracyRow("generation", 2048, "lynx", case, "equal_to_int8", 1.0))
    rows.append(AccuracyRow("fidelity", 1024, "int4", 0, "kl_vs_bf16", 0.25))
    return rows


def test_summary_means_and_standard_errors() -> None:
    summary = {(s.workload, s.context, s.scheme, s.metric): s for s in summarize(_rows())}
    int4 = summary[("generation", 2048, "int4", "full_match_vs_bf16")]
    assert int4.mean == pytest.approx(1 / 3) and int4.cases == 3
    assert int4.stderr == pytest.approx(math.sqrt((2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 2 / 3))
    assert summary[("generation", 2048, "bf16", "full_match_vs_bf16")].stderr == 0.0
    assert summary[("fidelity", 1024, "int4", "kl_vs_bf16")].stderr is None
    order = [(s.workload, s.scheme, s.metric) for s in summarize(_rows())]
    assert order[0] == ("fidelity", "int4", "kl_vs_bf16")
    assert order[1:5] == [("generation", s, "full_match_vs_bf16") for s in ("bf16", "int8", "int4", "lynx")]
    assert lynx_mismatches(_rows()) == {}
    assert lynx_mismatches([*_rows(), AccuracyRow("fidelity", 1, "lynx-3", 0, "equal_to_int8", 0.0)]) == {"lynx-3": 1}


def test_report_json_has_the_fixed_fields(tmp_path: Path) -> None:
    path = write_report(tmp_path, {"cases": 3}, _rows())
    payload = json.loads(path.read_text())
    assert set(payload) == {"config", "rows", "summary"}
    assert ROW_FIELDS == ("workload", "context", "scheme", "case", "metric", "value")
    assert SUMMARY_FIELDS == ("workload", "context", "scheme", "metric", "mean", "stderr", "cases")
    assert all(tuple(r) == ROW_FIELDS for r in payload["rows"])
    assert all(tuple(s) == SUMMARY_FIELDS for s in payload["summary"])
    assert read_report(path) == ({"cases": 3}, _rows())
    table = summary_table(_rows())
    assert "generation: full_match_vs_bf16 (mean ± stderr over 3 cases)" in table
    assert "0.333 ±0.333" in table


def test_accuracy_png(tmp_path: Path) -> None:
    def run(scheme: str, bw: float, ttft: float, ttfct: float) -> Row:
        return Row(scheme, "4,4" if scheme == "lynx" else None, bw, 2048, 0, 0, ttft, ttfct, 1.0, None, None,
                   1, 0, 1, None, None, None, "")

    sweep = [run("int8", 1.0, 0.4, 0.4), run("int4", 1.0, 0.2, 0.2), run("lynx", 1.0, 0.21, 0.41),
             run("int8", 10.0, 0.1, 0.1)]
    bw, points = ttft_points(sweep, 2048)
    assert bw == 1.0 and points == {"int8": (0.4, 0.4), "int4": (0.2, 0.2), "lynx": (0.21, 0.41),
                                    "planes 4,4": (0.21, 0.41)}
    assert [_split_of(s) for s in ("lynx", "lynx-3", "lynx-2.2.4", "int8")] == ["4,4", "3,5", "2,2,4", None]
    for sweep_rows in (None, sweep, [run("int8", 1.0, 0.4, 0.4)]):
        path = plot_accuracy_report(_rows(), tmp_path / "acc.png", sweep_rows=sweep_rows)
        assert path.read_bytes()[:4] == b"\x89PNG"


def test_the_speculative_check_commits_greedy_on_the_full_cache() -> None:
    from lynx_bench.accuracy.eval import greedy, speculative_tokens
    from lynx_decode.model import KVBuffers
    from tests._speculative_helpers import ToyLM

    model = ToyLM(eos=False)
    prompt = [5, 9, 13, 2, 7, 30, 11]
    full = model.prefill(prompt).kv
    expected = greedy(model, model.cache_from(full), prompt[-1], 20)
    for delta in (0.0, 3.0, 49.0):  # an exact, a close and a bad draft cache
        draft = KVBuffers.from_layers([full.keys[0] + np.float32(delta)], [full.values[0]])
        assert list(speculative_tokens(model, prompt, draft, full, 20)) == expected
    assert list(speculative_tokens(model, prompt, full, full, 3)) == expected[:3]
