"""The public namespaces are exactly what `__all__` says, and the error tree has one root."""

import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import lynx_transport.errors as errors

#: Each layer's own errors module (its branch of the one tree).
ERROR_MODULES = ["lynx_transport.errors", "lynx_decode.errors", "lynx_bench.common.errors"]

PACKAGES = ["lynx_transport", "lynx_decode", "lynx_kernels", "lynx_bench"]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_exactly_public_namespace(name: str) -> None:
    module = importlib.import_module(name)
    public = {n for n in vars(module) if not n.startswith("_")}
    submodules = {n for n, v in vars(module).items() if inspect.ismodule(v)}
    assert set(module.__all__) == public - submodules


@pytest.mark.parametrize("name", ERROR_MODULES)
def test_every_error_derives_from_one_root(name: str) -> None:
    module = importlib.import_module(name)
    for error in module.__all__:
        cls = getattr(module, error)
        assert issubclass(cls, errors.LynxError), f"{name}.{error}"


def test_errors_are_defined_in_the_layer_that_raises_them() -> None:
    """The codec's and the model's errors in lynx_decode, the link's in lynx_bench;
    the transport's module keeps only the root, the transport's branch and the
    root-level errors every layer raises."""
    from lynx_bench.common.errors import LinkError
    from lynx_decode import errors as decode

    for cls in (decode.CodecError, decode.LayoutError, decode.DecodeError, decode.ModelError,
                decode.PromptError):
        assert cls.__module__ == "lynx_decode.errors", cls
    assert LinkError.__module__ == "lynx_bench.common.errors"
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert cls is errors.LynxError or issubclass(cls, errors.TransportError) \
            or cls in (errors.BackendError, errors.ConfigError), name


def test_no_top_level_kernels_package(tmp_path) -> None:
    """Lynx installs no top-level ``kernels`` (PyPI has a popular package of that name):
    asked from outside the checkout (``-I``: no cwd, no PYTHONPATH on sys.path, so the
    checkout's own ``kernels/`` folder is not found by accident, wherever the clone sits),
    the name is free or someone else's, while ``lynx_kernels`` is ours."""
    probe = ("import importlib.util, json; "
             "spec = lambda n: importlib.util.find_spec(n); "
             "print(json.dumps([None if spec(n) is None else spec(n).origin for n in ('kernels', 'lynx_kernels')]))")
    out = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout
    kernels, lynx_kernels = json.loads(out)
    ours = Path(lynx_kernels).parent
    assert kernels is None or Path(kernels).parent != ours, (kernels, lynx_kernels)
