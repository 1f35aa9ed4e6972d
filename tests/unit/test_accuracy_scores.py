"""The accuracy report's scorers on hand-built logits and token sequences: exact values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lynx_bench.accuracy.retrieval import retrieval_score
from lynx_bench.accuracy.scores import (
    agreeing_prefix,
    full_match,
    kl_divergence,
    log_softmax,
    mean_stderr,
    perplexity,
    prefix_agreement,
    sequence_nll,
    top1_agreement,
)

REF = np.array([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0]])


def test_top1_agreement_counts_matching_argmaxes() -> None:
    got = np.array([[0.0, 2.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # argmax 1, 1, 2 against 1, 0, 2
    assert top1_agreement(REF, got) == pytest.approx(2 / 3, abs=0)
    assert top1_agreement(REF, REF) == 1.0
    assert top1_agreement(REF, -REF) == 0.0


def test_top1_agreement_breaks_ties_on_the_first_index() -> None:
    tie = np.array([[1.0, 1.0, 0.0]])
    assert top1_agreement(tie, np.array([[0.0, 0.0, -1.0]])) == 1.0  # both argmax 0
    assert top1_agreement(tie, np.array([[0.0, 0.5, -1.0]])) == 0.0


def test_kl_divergence_is_exact_on_two_tokens() -> None:
    ref = np.array([[0.0, 0.0]])  # p = (1/2, 1/2)
    got = np.array([[math.log(3.0), 0.0]])  # q = (3/4, 1/4)
    expected = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert kl_divergence(ref, got) == pytest.approx(expected, rel=1e-12)
    assert kl_divergence(REF, REF) == pytest.approx(0.0, abs=1e-15)
    # the mean over positions: a second, identical position halves it
    assert kl_divergence(np.vstack([ref, ref]), np.vstack([got, ref])) == pytest.approx(expected / 2, rel=1e-12)


def test_kl_is_invariant_to_a_shift_of_the_logits() -> None:
    assert kl_divergence(REF, REF + 7.5) == pytest.approx(0.0, abs=1e-12)
    assert np.allclose(np.exp(log_softmax(REF)).sum(axis=-1), 1.0)


def test_perplexity_and_nll_of_hand_built_distributions() -> None:
    uniform = np.zeros((5, 4))
    assert perplexity(uniform, [0, 1, 2, 3, 0]) == pytest.approx(4.0, rel=1e-12)
    logits = np.array([[0.0, math.log(3.0)], [0.0, 0.0]])  # p(1) = 3/4, then p(0) = 1/2
    assert sequence_nll(logits, [1, 0]) == pytest.approx(-math.log(0.75) - math.log(0.5), rel=1e-12)
    assert perplexity(logits, [1, 0]) == pytest.approx(math.sqrt(1 / (0.75 * 0.5)), rel=1e-12)


def test_greedy_continuation_agreement() -> None:
    ref = [1, 2, 3, 4]
    assert agreeing_prefix(ref, [1, 2, 9, 4]) == 2
    assert prefix_agreement(ref, [1, 2, 9, 4]) == 0.5
    assert prefix_agreement(ref, [7, 2, 3, 4]) == 0.0
    assert prefix_agreement(ref, ref) == 1.0
    assert full_match(ref, [1, 2, 9, 4]) == 0.0
    assert full_match(ref, (1, 2, 3, 4)) == 1.0
    assert full_match(ref, [1, 2, 3]) == 0.0


def test_mean_and_standard_error() -> None:
    mean, err = mean_stderr([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert err == pytest.approx(math.sqrt((1.5**2 + 0.5**2 + 0.5**2 + 1.5**2) / 3 / 4), rel=1e-15)
    assert mean_stderr([0.25]) == (0.25, None)
    assert mean_stderr([1.0, 1.0, 1.0]) == (1.0, 0.0)


def test_retrieval_score_wants_the_answer_digits_first_and_in_order() -> None:
    assert retrieval_score(" 12345. Remember it.", ("12345",)) == 1.0
    assert retrieval_score(" 1234 5", ("12345",)) == 0.0
    assert retrieval_score(" 111, 222 and 333.", ("111", "222", "333")) == 1.0
    assert retrieval_score(" 222, 111 and 333.", ("111", "222", "333")) == 0.0
    assert retrieval_score(" 111 and 222", ("111", "222", "333")) == 0.0
    assert retrieval_score("no digits", ("1",)) == 0.0


@pytest.mark.parametrize("call", [
    lambda: top1_agreement(np.zeros((2, 3)), np.zeros((3, 3))),
    lambda: kl_divergence(np.zeros((0, 3)), np.zeros((0, 3))),
    lambda: sequence_nll(np.zeros((2, 3)), [0]),
    lambda: sequence_nll(np.zeros((1, 3)), [3]),
    lambda: prefix_agreement([], [1]),
    lambda: mean_stderr([]),
])
def test_scorers_refuse_mismatched_inputs(call) -> None:
    with pytest.raises(ValueError):
        call()
