"""The accuracy workloads' texts: real long documents found on the machine, no downloads.

Sources, in this order (:data:`DEFAULT_TEXTS`): the licence texts Debian ships in
``/usr/share/common-licenses`` (GPL, LGPL, GFDL, MPL, Apache; near-duplicate
versions left out) and ``pydoc``, every entry of the standard library's
``pydoc_data.topics`` in key order (about 110k tokens). A licence file that is
missing is skipped. **Fallback**: when none of them can be read (no such folder,
a Python without ``pydoc_data``), the corpus is :func:`lynx_bench.accuracy.workload.filler_prose`,
deterministic varied prose of the length needed, and :attr:`Corpus.source` says
``"filler-prose"`` (recorded in the report's config): the schemes still separate,
less than on real text.

A case is a window of ``context + continuation`` tokens of one document
(:func:`text_windows`), a pure function of the tokenizer, the corpus, the sizes
and the seed: case ``i`` reads document ``i mod n`` of those long enough, at an
offset drawn from ``random.Random(f"window:{seed}:{context}:{i}")``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lynx_transport.errors import ConfigError

from .workload import filler_prose

__all__ = ["LICENSES", "DEFAULT_TEXTS", "FALLBACK", "load_texts", "Corpus", "load_corpus", "TextWindow",
           "text_windows"]

LICENSES = Path("/usr/share/common-licenses")
#: the documents the workloads read, when present
DEFAULT_TEXTS: tuple[str, ...] = ("GPL-3", "LGPL-2.1", "GFDL-1.3", "MPL-1.1", "MPL-2.0", "GPL-2", "Apache-2.0",
                                  "pydoc")
#: :attr:`Corpus.source` when no document could be read
FALLBACK = "filler-prose"


def load_texts(names: Sequence[str], folder: Path = LICENSES) -> dict[str, str]:
    """Real long texts by name: a file of ``folder`` (the common licences), or ``pydoc``
    (Python's ``pydoc_data.topics``, every entry in key order). Raises ``OSError`` /
    ``ImportError`` for one that is missing."""
    out = {}
    for name in names:
        if name == "pydoc":
            from pydoc_data.topics import topics  # noqa: PLC0415 - only for this text

            out[name] = "\n\n".join(topics[key] for key in sorted(topics))
        else:
            out[name] = (folder / name).read_text(encoding="utf-8")
    return out


@dataclass(frozen=True)
class Corpus:
    """Tokenized documents by name (``source``: ``"texts"`` or :data:`FALLBACK`)."""

    documents: dict[str, tuple[int, ...]]
    source: str

    @property
    def longest(self) -> int:
        """Tokens in the longest document (0 for an empty corpus)."""
        return max((len(ids) for ids in self.documents.values()), default=0)


def load_corpus(tokenize: Callable[[str], list[int]], names: Sequence[str] = DEFAULT_TEXTS, *,
                folder: Path = LICENSES, fallback_tokens: int = 16384) -> Corpus:
    """The documents of ``names`` that can be read, tokenized; if none can, the
    fallback: one document of filler prose of ``fallback_tokens`` tokens."""
    docs: dict[str, tuple[int, ...]] = {}
    for name in names:
        try:
            text = load_texts([name], folder)[name]
        except (OSError, ImportError, UnicodeDecodeError):
            continue
        docs[name] = tuple(tokenize(text))
    if docs:
        return Corpus(docs, "texts")
    return Corpus({FALLBACK: tuple(tokenize(filler_prose(tokenize, fallback_tokens, 0)))}, FALLBACK)


@dataclass(frozen=True)
class TextWindow:
    """``ids``: ``context + continuation`` consecutive tokens of ``document`` from ``offset``."""

    document: str
    offset: int
    ids: tuple[int, ...]


def text_windows(corpus: Corpus, context: int, continuation: int, cases: int, seed: int) -> list[TextWindow]:
    """``cases`` windows of ``context + continuation`` tokens (module docstring).
    Raises :class:`ConfigError` when no document is that long."""
    need = context + continuation
    eligible = [name for name, ids in corpus.documents.items() if len(ids) >= need]
    if not eligible:
        raise ConfigError(f"context {context} + {continuation} continuation tokens is longer than every text "
                          f"available (the longest has {corpus.longest} tokens)")
    out = []
    for i in range(cases):
        name = eligible[i % len(eligible)]
        ids = corpus.documents[name]
        offset = random.Random(f"window:{seed}:{context}:{i}").randint(0, len(ids) - need)
        out.append(TextWindow(name, offset, ids[offset : offset + need]))
    return out
