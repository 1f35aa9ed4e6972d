"""Sweep configuration: parsed from the command line, validated before any work.

Every check that can fail (bandwidths, schemes, contexts against the model's
window, the output folder) runs here, so a bad argument is reported in the
first second instead of after minutes of prefill.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import tempfile
from pathlib import Path

from lynx_decode.codec_config import ANCHOR_BITS, DEFAULT_ANCHOR_BITS, MAX_BITS, MIN_BITS
from lynx_decode.timeouts import Timeouts
from lynx_transport.errors import ConfigError

__all__ = ["LinkMode", "SweepConfig", "QUICK", "parse_floats", "parse_ints", "check_writable_dir"]

SCHEMES = ("bf16", "int8", "int4", "lynx")


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
    anchor_bits: int = DEFAULT_ANCHOR_BITS
    link: LinkMode = LinkMode.SHAPER
    repeats: int = 3
    out: Path = Path("sweep-out")
    seed: int = 0
    #: the nodes' timeouts (``--*-timeout`` flags), handed to both node processes
    timeouts: Timeouts = dataclasses.field(default_factory=Timeouts)

    def validate(self, max_context: int | None = None) -> SweepConfig:
        """Raise :class:`ConfigError` naming the first bad field; returns self."""
        if not self.bandwidths_gbps:
            raise ConfigError("--bandwidths: give at least one bandwidth")
        for bw in self.bandwidths_gbps:
            if not bw > 0 or bw != bw or bw == float("inf"):
                raise ConfigError(f"--bandwidths: {bw:g} Gbit/s is not a positive finite rate")
        if not self.schemes:
            raise ConfigError("--schemes: give at least one scheme")
        for scheme in self.schemes:
            if scheme not in SCHEMES:
                raise ConfigError(f"--schemes: unknown scheme {scheme!r}; choose from {', '.join(SCHEMES)}")
        if not self.contexts:
            raise ConfigError("--contexts: give at least one context length")
        for ctx in self.contexts:
            if ctx < 64:
                raise ConfigError(f"--contexts: {ctx} tokens is too short (minimum 64)")
            if max_context is not None and ctx + self.new_tokens > max_context:
                raise ConfigError(
                    f"--contexts: {ctx} + {self.new_tokens} new tokens exceeds the model's "
                    f"context window of {max_context} tokens")
        for name, value, low in (("--prompts", self.prompts, 1), ("--new-tokens", self.new_tokens, 1),
                                 ("--repeats", self.repeats, 1)):
            if value < low:
                raise ConfigError(f"{name}: must be at least {low}, got {value}")
        if self.anchor_bits not in ANCHOR_BITS:
            raise ConfigError(f"--anchor-bits: must be in {MIN_BITS}..{MAX_BITS}, got {self.anchor_bits}")
        check_writable_dir(self.out, "--out")
        return self

    def to_json(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["link"] = self.link.value
        d["out"] = str(self.out)
        return d


QUICK = SweepConfig(bandwidths_gbps=(1.0, 10.0), contexts=(1024,), prompts=1, new_tokens=16,
                    repeats=1)


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


def check_writable_dir(path: Path, flag: str) -> None:
    """Create ``path`` if needed and prove a file can be written there."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".lynx-write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot write to {os.fspath(path)!r}: {exc.strerror or exc}") from None
