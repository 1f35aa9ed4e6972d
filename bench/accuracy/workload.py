"""Accuracy workloads that need no download: pass-key retrieval and filler prose.

A pass-key prompt hides a random five-digit key at a chosen depth (0 = the start
of the filler, 1 = the end) inside repetitive filler text and then asks for it —
the classic format of Mohtashami & Jaggi (2023). Prompts are sized to a target
token count with any tokenizer that has ``encode(text) -> list[int]``, and are a
pure function of ``(tokenizer, target_tokens, depth, seed, style)``.

:func:`score` is exact: 1.0 when the first run of digits in the generated text
is the key, else 0.0.

:func:`filler_prose` makes deterministic, varied prose of a target length for
exactness tests (greedy agreement between KV schemes), where the content does
not matter but repetition would make the comparison too easy.

Usage::

    case = passkey_prompt(tokenizer, target_tokens=2048, depth=0.5, seed=7)
    text = generate(case.prompt)              # whatever runs the model
    accuracy = score(text, case.key)
"""

from __future__ import annotations

import enum
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from lynx_transport.errors import ConfigError

__all__ = [
    "Tokenizer",
    "PromptStyle",
    "PassKeyCase",
    "DEFAULT_DEPTHS",
    "passkey_prompt",
    "passkey_cases",
    "filler_prose",
    "score",
]

#: Depths used by :func:`passkey_cases` unless told otherwise: where the full-precision
#: SmolLM2-135M-Instruct finds the key in PLAIN prompts at both 2k and 4k tokens —
#: 8 of 8 prompts at each of these depths and lengths (``lynx passkey``, seeds
#: 1000-1002 and 2000-2004). At 4k a needle at depth 1.0, right before the
#: question, failed 8 of 8 (2k: 8 of 8 correct); the CHATML wrapping failed at
#: depths 0.25-0.75 already at 2k.
DEFAULT_DEPTHS: tuple[float, ...] = (0.5, 0.9, 0.0)


class _Encodes(Protocol):
    def encode(self, text: str) -> list[int]: ...


#: Anything that turns text into token ids: an object with ``encode(text)`` (a
#: Hugging Face tokenizer) or a plain function (``CausalLM.tokenize``).
Tokenizer = _Encodes | Callable[[str], list[int]]


def _encoder(tokenizer: Tokenizer) -> Callable[[str], list[int]]:
    encode = getattr(tokenizer, "encode", None)
    if callable(encode):
        return encode
    if callable(tokenizer):
        return tokenizer
    raise ConfigError(f"tokenizer must have encode(text) or be callable, got {tokenizer!r}")


class PromptStyle(enum.Enum):
    """How the task is wrapped: plain text, or the ChatML turns of instruct models
    (SmolLM2-Instruct) with the assistant's answer already begun."""

    PLAIN = "plain"
    CHATML = "chatml"


@dataclass(frozen=True)
class PassKeyCase:
    """One pass-key prompt and its ground truth."""

    prompt: str
    key: str
    depth: float
    target_tokens: int
    n_tokens: int
    seed: int
    style: PromptStyle


_TASK = ("There is an important info hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about the important information there.")
_FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.",
           "Here we go.", "There and back again.")
_QUESTION = "What is the pass key?"
_ANSWER_START = "The pass key is"
_CHATML_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


def _assemble(style: PromptStyle, before: str, needle: str, after: str) -> str:
    haystack = " ".join(part for part in (before, needle, after) if part)
    if style is PromptStyle.PLAIN:
        return f"{_TASK}\n{haystack}\n{_QUESTION} {_ANSWER_START}"
    return (f"<|im_start|>system\n{_CHATML_SYSTEM}<|im_end|>\n"
            f"<|im_start|>user\n{_TASK}\n{haystack}\n{_QUESTION}<|im_end|>\n"
            f"<|im_start|>assistant\n{_ANSWER_START}")


def _check_common(target_tokens: int, seed: int) -> None:
    if isinstance(target_tokens, bool) or not isinstance(target_tokens, int) or target_tokens <= 0:
        raise ConfigError(f"target_tokens must be a positive integer, got {target_tokens!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")


def _fit(tokenizer: Tokenizer, target_tokens: int, build: Callable[[int], str],
         what: str) -> tuple[str, int]:
    """Largest ``n`` (filler units) with ``len(encode(build(n))) <= target``."""
    encode = _encoder(tokenizer)

    def count(n: int) -> int:
        return len(encode(build(n)))

    base = count(0)
    if base > target_tokens:
        raise ConfigError(f"target_tokens={target_tokens} is too small: the {what} "
                          f"alone takes {base} tokens")
    lo, hi = 0, 1
    while count(hi) <= target_tokens:  # grow until past the target
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # invariant: count(lo) <= target < count(hi)
        mid = (lo + hi) // 2
        if count(mid) <= target_tokens:
            lo = mid
        else:
            hi = mid
    text = build(lo)
    return text, len(encode(text))


def passkey_prompt(tokenizer: Tokenizer, target_tokens: int, depth: float, seed: int,
                   style: PromptStyle = PromptStyle.PLAIN) -> PassKeyCase:
    """A pass-key prompt of at most ``target_tokens`` tokens (as close as one filler
    sentence, about five tokens, allows) with the needle after ``depth`` of the filler.

    Raises :class:`ConfigError` for a depth outside [0, 1], a non-positive target or
    a target too small to hold the task.
    """
    _check_common(target_tokens, seed)
    if not isinstance(depth, (int, float)) or isinstance(depth, bool) or not 0.0 <= depth <= 1.0:
        raise ConfigError(f"depth must be a number in [0, 1], got {depth!r}")
    try:
        style = PromptStyle(style)
    except ValueError as exc:
        raise ConfigError(f"style must be one of {[s.value for s in PromptStyle]}, "
                          f"got {style!r}") from exc
    key = str(random.Random(f"passkey:{seed}").randint(10000, 99999))
    needle = _needle(key)

    def build(n_sentences: int) -> str:
        filler = [_FILLER[i % len(_FILLER)] for i in range(n_sentences)]
        cut = round(depth * n_sentences)
        return _assemble(style, " ".join(filler[:cut]), needle, " ".join(filler[cut:]))

    prompt, n_tokens = _fit(tokenizer, target_tokens, build, "pass-key task")
    return PassKeyCase(prompt=prompt, key=key, depth=float(depth), target_tokens=target_tokens,
                       n_tokens=n_tokens, seed=seed, style=style)


def passkey_cases(tokenizer: Tokenizer, target_tokens: int, n: int, seed: int,
                  depths: Sequence[float] = DEFAULT_DEPTHS,
                  style: PromptStyle = PromptStyle.PLAIN) -> list[PassKeyCase]:
    """``n`` cases cycling through ``depths``; case ``i`` uses seed ``seed + i``."""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ConfigError(f"n must be a positive integer, got {n!r}")
    if not depths:
        raise ConfigError("depths must not be empty")
    return [passkey_prompt(tokenizer, target_tokens, depths[i % len(depths)], seed + i, style)
            for i in range(n)]


_SUBJECTS = ["The old harbour", "A quiet engineer", "The river", "Every morning the market",
             "The committee", "A small bird", "The northern road", "Her grandfather",
             "The library", "A distant storm", "The young pianist", "The village baker"]
_VERBS = ["watched", "remembered", "carried", "described", "ignored", "followed",
          "repaired", "painted", "measured", "welcomed", "questioned", "abandoned"]
_OBJECTS = ["the broken lantern", "a letter from the coast", "the long winter",
            "three wooden boats", "the sound of the bells", "a map of the valley",
            "the last train home", "an unfinished song", "the garden wall",
            "a basket of apples", "the evening news", "the silver key"]
_TAILS = ["before the rain began", "with great patience", "for reasons nobody knew",
          "while the town slept", "as the light faded", "without a single word",
          "near the old mill", "after the festival", "in the early spring",
          "under a grey sky", "long after midnight", "on the far side of the hill"]


def filler_prose(tokenizer: Tokenizer, target_tokens: int, seed: int) -> str:
    """Deterministic varied prose of at most ``target_tokens`` tokens (within one
    word of it), a pure function of ``(tokenizer, target_tokens, seed)``."""
    _check_common(target_tokens, seed)
    rng = random.Random(f"prose:{seed}")
    words: list[str] = []

    def build(n_words: int) -> str:
        while len(words) < n_words:
            sentence = (f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} "
                        f"{rng.choice(_OBJECTS)} {rng.choice(_TAILS)}.")
            words.extend(sentence.split())
        return " ".join(words[:n_words])

    text, _ = _fit(tokenizer, target_tokens, build, "empty text")
    return text


_DIGITS = re.compile(r"\d+")


def score(generated_text: str, key: str) -> float:
    """1.0 when the first run of digits in ``generated_text`` equals ``key``, else 0.0."""
    match = _DIGITS.search(generated_text)
    return 1.0 if match is not None and match.group(0) == key else 0.0
