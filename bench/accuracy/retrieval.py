"""The retrieval workload's prompts: needles of digits in a haystack of real text.

Three kinds (:class:`Retrieval`), cycled over the cases:

- ``passkey``: one five-digit pass key (the needle of :mod:`lynx_bench.accuracy.workload`);
- ``multi-key``: four needles "The key for NAME is NNNNNNNNNN." with ten-digit
  numbers, the question asking for one of them;
- ``multi-value``: three needles "One of the numbers for NAME is NNNNNNN.", all
  for one name, the question asking for all of them (in the order hidden).

The haystack is a window of the corpus (:mod:`lynx_bench.accuracy.texts`); the
needles go in at seeded depths between its tokens. A prompt is assembled from
token ids (task, haystack pieces, needles, question and the answer's start, each
tokenized on its own), so it is exactly ``context`` tokens and a pure function of
the tokenizer, the corpus, ``context`` and the seed. :func:`retrieval_score` is
exact: 1.0 when the digit runs of the generated text begin with the answer's.
"""

from __future__ import annotations

import enum
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from lynx_transport.errors import ConfigError

from .texts import Corpus, text_windows

__all__ = ["Retrieval", "RetrievalCase", "retrieval_cases", "retrieval_score"]

_NAMES = ("Amsterdam", "Bergen", "Cordoba", "Dakar", "Eindhoven", "Florence", "Geneva", "Hanoi",
          "Izmir", "Jaipur", "Kyoto", "Lagos", "Malmo", "Nairobi", "Oslo", "Porto")
_TASK = ("There is important information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about the important information there.\n")


class Retrieval(enum.Enum):
    """The kind of needle a retrieval case hides."""

    PASSKEY = "passkey"
    MULTI_KEY = "multi-key"
    MULTI_VALUE = "multi-value"


@dataclass(frozen=True)
class RetrievalCase:
    """A prompt of ``context`` token ids and its answer: ``values`` (digit strings, in
    the order the answer gives them) and ``answer_ids``, the canonical answer's tokens
    that follow the prompt (scored teacher-forced for the answer NLL)."""

    kind: Retrieval
    prompt: tuple[int, ...]
    values: tuple[str, ...]
    answer_ids: tuple[int, ...]
    depths: tuple[float, ...]


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


def _needles(kind: Retrieval, rng: random.Random) -> tuple[list[str], str, str, tuple[str, ...]]:
    """(needle sentences, question, answer start, answer values)."""
    if kind is Retrieval.PASSKEY:
        key = _digits(rng, 5)
        return ([f" The pass key is {key}. Remember it. {key} is the pass key. "],
                "What is the pass key?", " The pass key is", (key,))
    names = rng.sample(_NAMES, 4)
    if kind is Retrieval.MULTI_KEY:
        keys = [_digits(rng, 10) for _ in names]
        pick = rng.randrange(len(names))
        return ([f" The key for {n} is {k}. " for n, k in zip(names, keys)],
                f"What is the key for {names[pick]}?", f" The key for {names[pick]} is", (keys[pick],))
    values = tuple(_digits(rng, 7) for _ in range(3))
    name = names[0]
    return ([f" One of the numbers for {name} is {v}. " for v in values],
            f"What are all the numbers for {name}?", f" The numbers for {name} are", values)


def _answer_text(values: tuple[str, ...]) -> str:
    if len(values) == 1:
        return f" {values[0]}."
    return " " + ", ".join(values[:-1]) + f" and {values[-1]}."


def retrieval_cases(tokenize: Callable[[str], list[int]], corpus: Corpus, context: int, cases: int,
                    seed: int) -> list[RetrievalCase]:
    """``cases`` prompts of exactly ``context`` tokens, case ``i`` of kind ``i mod 3``.
    Raises :class:`ConfigError` when ``context`` cannot hold a task and its needles
    or is longer than the texts."""
    out = []
    kinds = list(Retrieval)
    windows = text_windows(corpus, context, 0, cases, seed + 7919)  # haystacks: other windows than the texts'
    for i in range(cases):
        kind = kinds[i % len(kinds)]
        rng = random.Random(f"retrieval:{seed}:{context}:{i}")
        needles, question, start, values = _needles(kind, rng)
        head = tokenize(_TASK)
        tail = tokenize(f"\n{question}{start}")
        pieces = [tokenize(n) for n in needles]
        room = context - len(head) - len(tail) - sum(len(p) for p in pieces)
        if room < 16:
            raise ConfigError(f"context {context} is too short for a {kind.value} retrieval prompt "
                              f"(it needs more than {context - room + 16} tokens)")
        hay = list(windows[i].ids[:room])
        depths = sorted(rng.uniform(0.05, 0.95) for _ in pieces)
        cuts = [round(d * room) for d in depths]
        prompt, last = list(head), 0
        for cut, piece in zip(cuts, pieces):
            prompt += hay[last:cut] + piece
            last = cut
        prompt += hay[last:] + tail
        assert len(prompt) == context  # by construction
        out.append(RetrievalCase(kind, tuple(prompt), values, tuple(tokenize(_answer_text(values))),
                                 tuple(round(d, 4) for d in depths)))
    return out


_RUN = re.compile(r"\d+")


def retrieval_score(generated_text: str, values: tuple[str, ...]) -> float:
    """1.0 when the first ``len(values)`` runs of digits in ``generated_text`` are
    ``values`` in order, else 0.0."""
    runs = _RUN.findall(generated_text)
    return float(tuple(runs[: len(values)]) == tuple(values))
