"""A prompt's token count before the model loads, where that is cheap.

A command refuses a prompt too short to decode (fewer than 2 tokens) before it
loads torch and the weights when the model directory holds a ``tokenizer.json``
(every fast tokenizer's saved form, and the form the default model is converted
into): the Rust ``tokenizers`` library reads it in milliseconds and encodes the way
the loaded model's tokenizer does (same normaliser, pre-tokeniser, model and
post-processor, so the same special tokens). Where it cannot tell cheaply (a GGUF
not converted yet, no ``tokenizer.json``, ``tokenizers`` missing or unable to read
the file) the answer is ``None`` and the caller counts with the loaded model, which
stays the authority for every prompt that is long enough.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["early_token_count"]


def early_token_count(directory: Path | None, text: str) -> int | None:
    """How many tokens ``text`` encodes to with the tokenizer saved in ``directory``
    (special tokens added as the model's tokenizer adds them), or ``None`` when that
    cannot be told without loading the model."""
    if directory is None:
        return None
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415 - optional, light (no torch)

        tokenizer = Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - not installed, or a file it cannot read: the loaded model decides
        return None
    return len(tokenizer.encode(text).ids)
