"""The accuracy report's scorers: pure functions of logits and token sequences.

Every scorer takes NumPy arrays or plain sequences (no model, no codec), so the
tests drive them with hand-built inputs and exact expected values. Logits are
``[positions, vocab]``; a reference (``ref``) is the BF16 cache's, a scheme's
the cache under test. Log-probabilities are computed in float64.

- :func:`top1_agreement`: fraction of positions whose argmax equals the reference's.
- :func:`kl_divergence`: mean over positions of ``KL(ref || scheme)``, nats.
- :func:`perplexity`: ``exp`` of the mean negative log-likelihood of the true tokens.
- :func:`sequence_nll`: the summed negative log-likelihood of a token sequence, nats.
- :func:`agreeing_prefix`, :func:`prefix_agreement`, :func:`full_match`: greedy
  continuations against the reference's.
- :func:`mean_stderr`: the summary of one metric over cases.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "log_softmax",
    "top1_agreement",
    "kl_divergence",
    "perplexity",
    "sequence_nll",
    "agreeing_prefix",
    "prefix_agreement",
    "full_match",
    "mean_stderr",
]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities over the last axis."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _pair(ref: np.ndarray, got: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ref, got = np.asarray(ref), np.asarray(got)
    if ref.ndim != 2 or ref.shape != got.shape or ref.shape[0] == 0:
        raise ValueError(f"logits must be two equal non-empty [positions, vocab] arrays, "
                         f"got {ref.shape} and {got.shape}")
    return ref, got


def top1_agreement(ref: np.ndarray, got: np.ndarray) -> float:
    """Fraction of positions where ``got``'s argmax is ``ref``'s (first index on ties)."""
    ref, got = _pair(ref, got)
    return float((ref.argmax(axis=-1) == got.argmax(axis=-1)).mean())


def kl_divergence(ref: np.ndarray, got: np.ndarray) -> float:
    """Mean over positions of ``KL(softmax(ref) || softmax(got))`` in nats."""
    ref, got = _pair(ref, got)
    lp_ref, lp_got = log_softmax(ref), log_softmax(got)
    return float((np.exp(lp_ref) * (lp_ref - lp_got)).sum(axis=-1).mean())


def _targets(logits: np.ndarray, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    logits = np.asarray(logits)
    ids = np.asarray([int(t) for t in tokens], np.int64)
    if logits.ndim != 2 or logits.shape[0] != len(ids) or len(ids) == 0:
        raise ValueError(f"need one [vocab] row of logits per token, got {logits.shape} for {len(ids)} tokens")
    if ids.min() < 0 or ids.max() >= logits.shape[1]:
        raise ValueError(f"token ids must be in [0, {logits.shape[1]})")
    return logits, ids


def sequence_nll(logits: np.ndarray, tokens: Sequence[int]) -> float:
    """Summed ``-log p(tokens[i])`` under ``logits[i]`` (row ``i`` predicts token ``i``), nats."""
    logits, ids = _targets(logits, tokens)
    lp = log_softmax(logits)
    return float(-lp[np.arange(len(ids)), ids].sum())


def perplexity(logits: np.ndarray, tokens: Sequence[int]) -> float:
    """``exp(sequence_nll / len(tokens))``: the perplexity of the true continuation."""
    return math.exp(sequence_nll(logits, tokens) / len(tokens))


def agreeing_prefix(ref: Sequence[int], got: Sequence[int]) -> int:
    """How many leading tokens ``got`` shares with ``ref``."""
    n = 0
    for a, b in zip(ref, got):
        if int(a) != int(b):
            break
        n += 1
    return n


def prefix_agreement(ref: Sequence[int], got: Sequence[int]) -> float:
    """The agreeing prefix as a fraction of ``ref``'s length (1.0: all of it)."""
    if not ref:
        raise ValueError("the reference continuation is empty")
    return agreeing_prefix(ref, got) / len(ref)


def full_match(ref: Sequence[int], got: Sequence[int]) -> float:
    """1.0 when the two continuations are identical, else 0.0."""
    return float([int(t) for t in ref] == [int(t) for t in got])


def mean_stderr(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (sample standard deviation over
    ``sqrt(n)``; None for a single value)."""
    if not values:
        raise ValueError("no values to summarise")
    vals = [float(v) for v in values]
    mean = math.fsum(vals) / len(vals)
    if len(vals) < 2:
        return mean, None
    var = math.fsum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return mean, math.sqrt(var / len(vals))
