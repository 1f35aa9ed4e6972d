"""A prompt's token count before the model loads (``lynx_decode.model.tokens``): the
saved ``tokenizer.json`` counts as the loaded tokenizer does, and every case it cannot
read is ``None`` (the loaded model decides), never a wrong count or an exception."""

from __future__ import annotations

from pathlib import Path

import pytest

from lynx_decode.model.tokens import early_token_count
from tests._tiny_models import tokenizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("tok")
    tok = tokenizer()
    tok.save_pretrained(folder)
    return folder, tok


@pytest.mark.parametrize("text", ["", "a", "ab", "hello there", "naïve — ünïcode\n"])
def test_the_saved_tokenizer_counts_as_the_loaded_one(saved: tuple[Path, object], text: str) -> None:
    folder, tok = saved
    assert early_token_count(folder, text) == len(tok(text)["input_ids"])  # type: ignore[operator]


def test_what_it_cannot_read_is_none(tmp_path: Path) -> None:
    assert early_token_count(None, "a") is None
    assert early_token_count(tmp_path, "a") is None  # no tokenizer.json
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert early_token_count(tmp_path, "a") is None
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    assert early_token_count(tmp_path, "a") is None
