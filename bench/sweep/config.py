"""Sweep configuration: parsed from the command line, validated before any work.

Every check that can fail (bandwidths, schemes, LYNX splits, contexts against the
model's window, the output folder) runs here, so a bad argument is reported in the
first second instead of after minutes of prefill.

LYNX splits: ``--anchor-bits 4,3`` (each ``b`` is the split ``(b, 8 - b)``) or
``--planes 4,4 2,2,4`` (plane widths from the top bit down), not both. Each split
is a scheme of its own in every table, JSON file and plot, named by
:func:`lynx_scheme_name`: ``lynx`` when the sweep asks for the default split alone,
otherwise ``lynx-<planes_name>`` (``lynx-4``, ``lynx-3``, ``lynx-2.2.4``).
``--schemes`` also takes those names directly (``--schemes int8,lynx-4,lynx-3``),
and ``lynx-auto``: the decode node chooses the split for each run
(``--planes auto``, :mod:`lynx_decode.split_choice`), possibly none (then it runs
INT8; the run's ``planes`` say what was chosen).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import tempfile
from pathlib import Path
from typing import Any

from lynx_decode.codec.config import (
    ANCHOR_BITS,
    DEFAULT_ANCHOR_BITS,
    MAX_BITS,
    MIN_BITS,
    check_planes,
    parse_planes,
    planes_name,
)
from lynx_decode.errors import CodecError
from lynx_decode.timeouts import Timeouts
from lynx_transport.errors import ConfigError

__all__ = ["LinkMode", "SweepWorkload", "DEFAULT_WORKLOAD", "TEXT_CONTINUATION", "SweepConfig", "SweepScheme",
           "QUICK", "SCHEMES", "AUTO_SCHEME", "split_of_scheme", "DEFAULT_PLANES", "is_lynx",
           "lynx_scheme_name", "parse_floats", "parse_ints", "parse_planes_flag", "scheme_flag_changes",
           "check_schemes", "check_writable_dir"]

SCHEMES = ("bf16", "int8", "int4", "lynx")
#: The sweep scheme whose split the decode node chooses per run.
AUTO_SCHEME = "lynx-auto"
#: The LYNX split a sweep runs when neither ``--anchor-bits`` nor ``--planes`` is given.
DEFAULT_PLANES: tuple[int, ...] = (DEFAULT_ANCHOR_BITS, 8 - DEFAULT_ANCHOR_BITS)


def is_lynx(scheme: str) -> bool:
    """Whether a sweep scheme name is a LYNX split (``lynx``, ``lynx-3``, ``lynx-2.2.4``, ...)."""
    return scheme == "lynx" or scheme.startswith("lynx-")


def split_of_scheme(name: str) -> tuple[int, ...] | None:
    """The split a ``lynx-<planes_name>`` scheme name stands for (``lynx-4`` is 4,4,
    ``lynx-2.2.4`` is 2,2,4); None for any other name (``lynx-auto`` included)."""
    if not name.startswith("lynx-") or name == AUTO_SCHEME:
        return None
    widths = name[len("lynx-"):].split(".")
    try:
        planes = [int(w) for w in widths]
        split = (planes[0], 8 - planes[0]) if len(planes) == 1 else tuple(planes)
        return check_planes(split)
    except (ValueError, CodecError):
        return None


def lynx_scheme_name(planes: tuple[int, ...], splits: tuple[tuple[int, ...], ...]) -> str:
    """The sweep scheme name of the split ``planes`` in a sweep of ``splits``: ``lynx``
    when the default split is the only one asked for, else ``lynx-<planes_name>``."""
    if tuple(splits) == (DEFAULT_PLANES,) and tuple(planes) == DEFAULT_PLANES:
        return "lynx"
    return f"lynx-{planes_name(tuple(planes))}"


@dataclasses.dataclass(frozen=True)
class SweepScheme:
    """One scheme as the sweep runs it: ``name`` in tables, JSON and plots; ``scheme``
    the codec's scheme (``Scheme`` value) the decode node asks for; ``planes`` the
    LYNX split (None for every other scheme, and for ``lynx-auto``, whose split the
    decode node chooses: ``auto``)."""

    name: str
    scheme: str
    planes: tuple[int, ...] | None = None
    auto: bool = False


class SweepWorkload(enum.Enum):
    """What the sweep's prompts are and what its ``accuracy`` column scores.

    ``fidelity`` (the default): windows of real text (:mod:`lynx_bench.accuracy.texts`);
    teacher-forced top-1 agreement with BF16 over the next :data:`TEXT_CONTINUATION`
    true tokens, computed after the timed runs in the sweep's own process through the
    codec (``lynx accuracy``'s ``top1_agreement_vs_bf16``). ``generation``: the same
    windows, 1.0 when the run's new tokens all equal BF16's for the same prompt (the
    ``full_match_vs_bf16`` of ``lynx accuracy``, on the tokens the timed run produced).
    ``passkey``: pass-key prompts (:mod:`lynx_bench.accuracy.workload`), 1.0 when the run's text
    holds the key; every scheme scores 1.0 on the default model, so it does not
    separate them.
    """

    PASSKEY = "passkey"
    FIDELITY = "fidelity"
    GENERATION = "generation"


#: the sweep's workload unless ``--workload`` says otherwise: it separated INT4 from INT8
#: by the most standard errors in ``lynx accuracy`` (about 12 at 2k and 4k tokens, against
#: 9 and 5 for generation), and stays steady with the sweep's one or two prompts (README)
DEFAULT_WORKLOAD = SweepWorkload.FIDELITY
#: text-window tokens past the prompt (teacher-forced by ``--workload fidelity``)
TEXT_CONTINUATION = 256


class LinkMode(enum.Enum):
    """How the link rate is imposed: the transport's own shaper, or tc in namespaces."""

    SHAPER = "shaper"
    NETNS = "netns"


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    bandwidths_gbps: tuple[float, ...] = (0.5, 1.0, 2.0, 5.0, 10.0)
    contexts: tuple[int, ...] = (2048, 4096)
    schemes: tuple[str, ...] = SCHEMES
    prompts: int = 2
    new_tokens: int = 32
    #: ``--anchor-bits 4,3``: LYNX splits ``(b, 8 - b)``; None when not given
    anchor_bits: tuple[int, ...] | None = None
    #: ``--planes 4,4 2,2,4``: LYNX splits; None when not given (never with ``anchor_bits``)
    planes: tuple[tuple[int, ...], ...] | None = None
    link: LinkMode = LinkMode.SHAPER
    repeats: int = 3
    out: Path = Path("sweep-out")
    seed: int = 0
    #: the prompts and the ``accuracy`` column (:class:`SweepWorkload`)
    workload: SweepWorkload = DEFAULT_WORKLOAD
    #: the nodes' timeouts (``--*-timeout`` flags), handed to both node processes
    timeouts: Timeouts = dataclasses.field(default_factory=Timeouts)

    @property
    def splits(self) -> tuple[tuple[int, ...], ...]:
        """The LYNX splits to run, in the order given (the default split when none was)."""
        if self.planes is not None:
            return tuple(tuple(p) for p in self.planes)
        if self.anchor_bits is not None:
            return tuple((b, 8 - b) for b in self.anchor_bits)
        return (DEFAULT_PLANES,)

    @property
    def sweep_schemes(self) -> tuple[SweepScheme, ...]:
        """``schemes`` as run, in order, ``lynx`` expanded into one scheme per split."""
        out: list[SweepScheme] = []
        for scheme in self.schemes:
            split = split_of_scheme(scheme)
            if scheme == "lynx":
                splits = self.splits
                out += [SweepScheme(lynx_scheme_name(p, splits), "lynx", p) for p in splits]
            elif scheme == AUTO_SCHEME:
                out.append(SweepScheme(scheme, "lynx", auto=True))
            elif split is not None:
                out.append(SweepScheme(scheme, "lynx", split))
            else:
                out.append(SweepScheme(scheme, scheme))
        names = [s.name for s in out]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"--schemes: {', '.join(twice)} would run twice (a split named in "
                              "--schemes and again by --planes or --anchor-bits)")
        return tuple(out)

    def validate(self, max_context: int | None = None) -> SweepConfig:
        """Raise :class:`ConfigError` naming the first bad field; returns self."""
        if not self.bandwidths_gbps:
            raise ConfigError("--bandwidths: give at least one bandwidth")
        for bw in self.bandwidths_gbps:
            if not bw > 0 or bw != bw or bw == float("inf"):
                raise ConfigError(f"--bandwidths: {bw:g} Gbit/s is not a positive finite rate")
        check_schemes(self.schemes)
        self.validate_splits()
        self.sweep_schemes  # noqa: B018 - raises ConfigError for a split that would run twice
        if not self.contexts:
            raise ConfigError("--contexts: give at least one context length")
        for ctx in self.contexts:
            if ctx < 64:
                raise ConfigError(f"--contexts: {ctx} tokens is too short (minimum 64)")
            if max_context is not None and ctx + self.new_tokens > max_context:
                raise ConfigError(
                    f"--contexts: {ctx} + {self.new_tokens} new tokens exceeds the model's "
                    f"context window of {max_context} tokens")
            if (max_context is not None and self.workload is SweepWorkload.FIDELITY
                    and ctx + TEXT_CONTINUATION > max_context):
                raise ConfigError(
                    f"--contexts: {ctx} + {TEXT_CONTINUATION} teacher-forced tokens (--workload fidelity) "
                    f"exceeds the model's context window of {max_context} tokens")
        for name, value, low in (("--prompts", self.prompts, 1), ("--new-tokens", self.new_tokens, 1),
                                 ("--repeats", self.repeats, 1)):
            if value < low:
                raise ConfigError(f"{name}: must be at least {low}, got {value}")
        check_writable_dir(self.out, "--out")
        return self

    def validate_splits(self) -> None:
        """The ``--anchor-bits`` / ``--planes`` checks alone (``lynx accuracy`` shares them)."""
        if self.anchor_bits is not None and self.planes is not None:
            raise ConfigError("--planes and --anchor-bits are mutually exclusive: give the splits with one of them")
        flag, given = ("--planes", self.planes) if self.planes is not None else ("--anchor-bits", self.anchor_bits)
        if given is None:
            return
        if not given:
            raise ConfigError(f"{flag}: give at least one split")
        if self.anchor_bits is not None:
            for bits in self.anchor_bits:
                if isinstance(bits, bool) or not isinstance(bits, int) or bits not in ANCHOR_BITS:
                    raise ConfigError(f"{flag}: anchor bits must be in {MIN_BITS}..{MAX_BITS}, got {bits!r}")
        else:
            for split in given:
                try:
                    check_planes(split)
                except CodecError as exc:
                    raise ConfigError(f"{flag}: {exc}") from None
        seen: set[tuple[int, ...]] = set()
        for split in self.splits:
            if split in seen:
                raise ConfigError(f"{flag}: the split {','.join(map(str, split))} is listed twice")
            seen.add(split)
        if "lynx" not in self.schemes:
            raise ConfigError(f"{flag}: sets LYNX splits, but lynx is not among --schemes "
                              f"({','.join(self.schemes)})")

    def to_json(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["link"] = self.link.value
        d["workload"] = self.workload.value
        d["out"] = str(self.out)
        d["splits"] = [list(p) for p in self.splits]
        d["sweep_schemes"] = [s.name for s in self.sweep_schemes]
        return d


#: ``--quick`` (``make demo``): the regime LYNX is for, a 4096-token prompt whose cache the
#: link must carry, from the bandwidth-bound end to where splitting stops paying; one
#: prompt, 16 tokens, one run per point (about three minutes after the install); LYNX as it
#: chooses its split for the link (lynx-auto) beside the fixed 4,4 split
QUICK = SweepConfig(bandwidths_gbps=(0.5, 1.0, 2.0, 5.0, 10.0), contexts=(4096,), prompts=1, new_tokens=16,
                    repeats=1, schemes=("bf16", "int8", "int4", AUTO_SCHEME, "lynx-4"))


def check_schemes(schemes: tuple[str, ...]) -> None:
    """``--schemes``: at least one, each known, none twice (:class:`ConfigError` naming the flag)."""
    if not schemes:
        raise ConfigError("--schemes: give at least one scheme")
    for scheme in schemes:
        if scheme not in SCHEMES and scheme != AUTO_SCHEME and split_of_scheme(scheme) is None:
            raise ConfigError(f"--schemes: unknown scheme {scheme!r}; choose from {', '.join(SCHEMES)}, "
                              f"{AUTO_SCHEME} or a split lynx-B / lynx-W.W.W (lynx-3: 3,5)")
        if schemes.count(scheme) > 1:
            raise ConfigError(f"--schemes: {scheme} is listed twice")


def scheme_flag_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields given by the flags the sweep and the accuracy report share
    (``--contexts``, ``--schemes``, ``--anchor-bits``, ``--planes``; those not given are left out)."""
    changes: dict[str, Any] = {}
    if args.contexts is not None:
        changes["contexts"] = parse_ints(args.contexts, "--contexts")
    if args.schemes is not None:
        changes["schemes"] = tuple(s.strip() for s in args.schemes.split(",") if s.strip())
    if args.anchor_bits is not None:
        changes["anchor_bits"] = parse_ints(args.anchor_bits, "--anchor-bits")
    if args.planes is not None:
        changes["planes"] = parse_planes_flag(args.planes, "--planes")
    return changes


def parse_floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def parse_planes_flag(texts: list[str] | tuple[str, ...], flag: str = "--planes") -> tuple[tuple[int, ...], ...]:
    """``["4,4", "2,2,4"]`` -> ``((4, 4), (2, 2, 4))``; a bad split raises
    :class:`ConfigError` naming ``flag`` with :func:`parse_planes`' reason."""
    out = []
    for text in texts:
        try:
            out.append(parse_planes(text))
        except CodecError as exc:
            raise ConfigError(f"{flag}: {exc}") from None
    return tuple(out)


def check_writable_dir(path: Path, flag: str) -> None:
    """Create ``path`` if needed and prove a file can be written there."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".lynx-write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot write to {os.fspath(path)!r}: {exc.strerror or exc}") from None
