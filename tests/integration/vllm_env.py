"""The vLLM environment the vLLM tests run their servers in (``make vllm-env``).

Without it the tests skip, saying how to get it. Where it must be there (``.ci/run`` sets
``LYNX_REQUIRE_VLLM=1`` after building it), its absence fails the collection instead: a
wrong path to the environment once skipped every vLLM test silently.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lynx_bench.vllm.driver import INSTALL_HINT, vllm_env_dir, vllm_python

__all__ = ["REQUIRE_ENV", "vllm_python_or_skip"]

#: Set (to anything but "" or "0") where the vLLM environment must be present.
REQUIRE_ENV = "LYNX_REQUIRE_VLLM"


def vllm_python_or_skip() -> Path:
    """The vLLM environment's Python; at module level, skips the module without it
    (fails it when :data:`REQUIRE_ENV` is set)."""
    python = vllm_python()
    if python is not None:
        return python
    where = vllm_env_dir()
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        pytest.fail(f"{REQUIRE_ENV} is set, and the vLLM environment is not at {where}: {INSTALL_HINT}",
                    pytrace=False)
    pytest.skip(f"the vLLM environment is not installed ({where}): {INSTALL_HINT}", allow_module_level=True)
