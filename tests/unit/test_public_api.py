"""The public namespaces are exactly what `__all__` says, and the error tree has one root."""

import importlib
import inspect

import pytest

import lynx_transport.errors as errors

PACKAGES = ["lynx_transport", "lynx_decode", "lynx_kernels", "lynx_bench"]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_exactly_public_namespace(name: str) -> None:
    module = importlib.import_module(name)
    public = {n for n in vars(module) if not n.startswith("_")}
    submodules = {n for n, v in vars(module).items() if inspect.ismodule(v)}
    assert set(module.__all__) == public - submodules


def test_every_error_derives_from_one_root() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.LynxError), name


def test_no_top_level_kernels_package() -> None:
    assert importlib.util.find_spec("kernels") is None or "lynx" not in str(
        importlib.util.find_spec("kernels").origin
    )
