"""What ``lynx accuracy`` measures: the workloads, the metric names and the frozen config.

Every check that can fail without the model (workloads, schemes, splits, case
counts, token counts, contexts against the model's window, the output folder)
is in :meth:`AccuracyConfig.validate`, so a bad argument is reported before any
work; the contexts against the texts on the machine are checked once the corpus
is tokenized, still before the first prefill (:func:`lynx_bench.accuracy.report.check_corpus`).

Metrics (one row per workload, context, scheme, case and metric):

- ``fidelity`` (teacher-forced on the true continuation of a real text):
  ``top1_agreement_vs_bf16``, ``kl_vs_bf16`` (mean ``KL(bf16 || scheme)``, nats),
  ``ppl`` (perplexity of the true continuation); for a LYNX split also
  ``draft_top1_agreement_vs_bf16``, the same on its anchor-only cache (the draft quality);
- ``generation`` (greedy continuation of the same texts): ``full_match_vs_bf16``
  (1.0 when every token equals BF16's), ``prefix_agreement_vs_bf16`` (the agreeing
  prefix over the continuation's length);
- ``retrieval`` (needles in real text, :mod:`lynx_bench.accuracy.retrieval`):
  ``exact_match``, ``answer_nll`` (summed nats of the canonical answer, teacher-forced);
- every workload, LYNX splits only: ``equal_to_int8``, 1.0 when the split's full
  decode is bitwise INT8's cache (and, in ``generation``, the speculative engine's
  committed tokens are INT8's greedy tokens). LYNX's other metrics are then INT8's.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path

from lynx_transport.errors import ConfigError

from ..sweep.config import SCHEMES, SweepConfig, SweepScheme, check_schemes, check_writable_dir
from .texts import DEFAULT_TEXTS

__all__ = ["Workload", "METRICS", "HEADLINE", "AccuracyConfig", "parse_workloads"]


class Workload(enum.Enum):
    """An accuracy workload."""

    FIDELITY = "fidelity"
    GENERATION = "generation"
    RETRIEVAL = "retrieval"


#: metric names per workload, in report order
METRICS: dict[Workload, tuple[str, ...]] = {
    Workload.FIDELITY: ("top1_agreement_vs_bf16", "kl_vs_bf16", "ppl", "draft_top1_agreement_vs_bf16",
                        "equal_to_int8"),
    Workload.GENERATION: ("full_match_vs_bf16", "prefix_agreement_vs_bf16", "equal_to_int8"),
    Workload.RETRIEVAL: ("exact_match", "answer_nll", "equal_to_int8"),
}
#: the metrics ``accuracy.png`` draws per workload (fractions in [0, 1])
HEADLINE: dict[Workload, tuple[str, ...]] = {
    Workload.FIDELITY: ("top1_agreement_vs_bf16", "draft_top1_agreement_vs_bf16"),
    Workload.GENERATION: ("full_match_vs_bf16", "prefix_agreement_vs_bf16"),
    Workload.RETRIEVAL: ("exact_match",),
}


def parse_workloads(text: str) -> tuple[Workload, ...]:
    """``"fidelity,generation"`` -> the workloads; an unknown name raises :class:`ConfigError`."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            out.append(Workload(part))
        except ValueError:
            raise ConfigError(f"--workloads: unknown workload {part!r}; choose from "
                              f"{', '.join(w.value for w in Workload)}") from None
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class AccuracyConfig:
    workloads: tuple[Workload, ...] = tuple(Workload)
    contexts: tuple[int, ...] = (2048, 4096)
    schemes: tuple[str, ...] = SCHEMES
    #: ``--anchor-bits`` / ``--planes``: LYNX splits, each a scheme of its own (None: the
    #: default split alone, named ``lynx``), as in ``lynx sweep``
    anchor_bits: tuple[int, ...] | None = None
    planes: tuple[tuple[int, ...], ...] | None = None
    cases: int = 10
    #: teacher-forced tokens per fidelity case
    fidelity_tokens: int = 256
    #: greedy tokens per generation case
    generation_tokens: int = 64
    #: greedy tokens per retrieval answer
    answer_tokens: int = 24
    seed: int = 0
    texts: tuple[str, ...] = DEFAULT_TEXTS
    out: Path = Path("accuracy-out")

    @property
    def sweep_schemes(self) -> tuple[SweepScheme, ...]:
        """The schemes as reported, each LYNX split its own (as ``lynx sweep`` names them)."""
        return self._sweep.sweep_schemes

    @property
    def splits(self) -> tuple[tuple[int, ...], ...]:
        return self._sweep.splits

    @property
    def _sweep(self) -> SweepConfig:
        return SweepConfig(schemes=self.schemes, anchor_bits=self.anchor_bits, planes=self.planes)

    @property
    def continuation(self) -> int:
        """Tokens a text window needs past the prompt (fidelity and generation share windows)."""
        text = [w for w in self.workloads if w is not Workload.RETRIEVAL]
        if not text:
            return 0
        return max(self.fidelity_tokens if Workload.FIDELITY in text else 0,
                   self.generation_tokens if Workload.GENERATION in text else 0)

    def validate(self, max_context: int | None = None) -> AccuracyConfig:
        """Raise :class:`ConfigError` naming the first bad field; returns self."""
        if not self.workloads:
            raise ConfigError("--workloads: give at least one workload")
        for w in self.workloads:
            if not isinstance(w, Workload):
                raise ConfigError(f"--workloads: {w!r} is not a workload")
            if self.workloads.count(w) > 1:
                raise ConfigError(f"--workloads: {w.value} is listed twice")
        check_schemes(self.schemes)
        self._sweep.validate_splits()
        for name, value in (("--cases", self.cases), ("--fidelity-tokens", self.fidelity_tokens),
                            ("--generation-tokens", self.generation_tokens),
                            ("--answer-tokens", self.answer_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if not self.contexts:
            raise ConfigError("--contexts: give at least one context length")
        for ctx in self.contexts:
            if ctx < 64:
                raise ConfigError(f"--contexts: {ctx} tokens is too short (minimum 64)")
            need = ctx + max(self.continuation, self.answer_tokens if Workload.RETRIEVAL in self.workloads else 0)
            if max_context is not None and need > max_context:
                raise ConfigError(f"--contexts: {ctx} tokens plus {need - ctx} to score exceeds the model's "
                                  f"context window of {max_context} tokens")
        if not self.texts:
            raise ConfigError("--texts: give at least one text")
        check_writable_dir(self.out, "--out")
        return self

    def to_json(self) -> dict[str, object]:
        return {"workloads": [w.value for w in self.workloads], "contexts": list(self.contexts),
                "schemes": list(self.schemes), "splits": [list(p) for p in self.splits],
                "sweep_schemes": [s.name for s in self.sweep_schemes], "cases": self.cases,
                "fidelity_tokens": self.fidelity_tokens, "generation_tokens": self.generation_tokens,
                "answer_tokens": self.answer_tokens, "seed": self.seed, "texts": list(self.texts),
                "out": str(self.out), "reference": "bf16"}
