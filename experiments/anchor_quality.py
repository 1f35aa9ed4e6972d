"""How well does an anchor-only KV cache draft? Reconstruction rules for the top
bits of the INT8 codes, measured teacher-forced on real text.

Lynx splits every 8-bit code ``q`` (asymmetric INT8 over a group's ``[min, max]``,
255 steps) into the anchor ``a = q >> r`` (top ``b`` bits, ``r = 8 - b``) and a
residual. The decode node drafts on a cache rebuilt from the anchors alone; this
module compares ways to rebuild it (all decode-side, from the anchor bits and the
INT8 scale/zero, the 8-bit codes unchanged) against direct b-bit quantization:

``centre``     code ``a*2^r + (2^r-1)/2`` (the codec's rule today)
``edge``       centre, but ``a == 0`` -> code 0 and ``a == 2^b-1`` -> code 255
``quarter``    centre, but the end bins at 1/4 of the bin from the outer edge
``stretch``    code ``a * 255 / (2^b - 1)``: the b-bit levels of ``[min, max]``
``occupancy``  per group: an end bin holding exactly one value holds the group's
               extreme -> code 0 / 255 exactly; otherwise centre
``occ-quarter`` per group: an end bin holding exactly one value -> code 0 / 255,
               otherwise at 1/4 of the bin from the outer edge
``occ-mean``   per group: an end bin with ``n`` values -> ``(edge + (n-1)*centre)/n``
               (the extreme is one of them; the others at the bin centre)
``table``      code = conditional mean of the codes of bin ``a`` (per K/V), fitted
               on a held-out text (:func:`fit_tables`)
``table-occ``  ``table`` for interior bins; end bins by their occupancy ``n`` in the
               group (1, 2, 3, >= 4), each a fitted conditional mean

plus ``Split.ROUNDED`` (the codec's QuantSpec-style grid; anchor-only and full
8-bit), and the baselines fp32 (the reference itself: agreement 1 by construction,
its acceptance is the fp32-vs-INT8 floor), bf16, INT8, INT4 (the codec's), INT3
and INT2 (direct quantization in NumPy over the same groups).

Method (:func:`evaluate_text`): prefill ``P`` tokens of a text in fp32; for each
scheme quantize/dequantize every layer's K and V; teacher-force the next ``M``
tokens in one pass on that cache and compare with the fp32 cache per position
(top-1 agreement, mean ``KL(ref || scheme)``); and at several start positions
draft ``k`` tokens greedily on the scheme's cache against greedy on the INT8 cache
(the cache Lynx verifies against): acceptance = accepted / drafted, the greedy-
prefix rule (stop at the first disagreement), for ``k`` = 2, 4, 8. Drafting uses
the identity that a draft prefix is accepted exactly when it equals the INT8
greedy continuation, so the scheme's drafts are scored teacher-forced on that
continuation (one pass per start).

Run ``python experiments/anchor_quality.py`` (``--help`` for the flags).
torch is imported lazily (through the model). This is the research tool behind
the codec's reconstruction rule; ``lynx accuracy`` (:mod:`lynx_bench.accuracy.report`)
is the report per scheme, and both share the texts (:mod:`lynx_bench.accuracy.texts`),
the scorers (:mod:`lynx_bench.accuracy.scores`) and the codec round trip
(:func:`lynx_bench.accuracy.schemes.codec_layers`).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from lynx_bench.accuracy.schemes import codec_layers
from lynx_bench.accuracy.scores import kl_divergence, top1_agreement
from lynx_bench.accuracy.texts import load_texts
from lynx_decode import CodecConfig, Scheme, Split, encode_layer
from lynx_decode.model import HFCausalLM, KVBuffers, SlabCache

__all__ = [
    "Grid",
    "Tables",
    "Metrics",
    "RULES",
    "int8_grids",
    "occ_mean_inset",
    "reconstruct",
    "direct_quant",
    "fit_tables",
    "build_schemes",
    "load_texts",
    "evaluate_text",
    "main",
]

K_GROUP = 64
V_GROUP = 64
EVAL_TEXTS = ("GPL-3", "LGPL-2.1", "MPL-2.0", "pydoc")
FIT_TEXT = "Apache-2.0"  # held out: the learned tables are fitted on it, never evaluated on it
END_COUNTS = 4  # table-occ: end-bin occupancies 1, 2, 3 and >= 4

Layer = tuple[np.ndarray, np.ndarray]  # K, V [kv_heads, tokens, head_dim] fp32
SchemeFn = Callable[[np.ndarray, np.ndarray], Layer]


# --------------------------------------------------------------------------- grids


@dataclass(frozen=True)
class Grid:
    """One tensor's plain INT8 grid: codes ``[H, T, D]`` uint8 and fp32 scale/zero of
    the groups (K ``[H, ceil(T/g), D]``: per channel over ``g`` tokens; V
    ``[H, T, ceil(D/g)]``: per token over ``g`` channels)."""

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    kind: str  # "k" or "v"
    group: int

    def expand(self, p: np.ndarray) -> np.ndarray:
        """Broadcast group parameters to ``[H, T, D]``."""
        _heads, tokens, dim = self.codes.shape
        if self.kind == "k":
            return np.repeat(p, self.group, axis=1)[:, :tokens]
        return np.repeat(p, self.group, axis=2)[:, :, :dim]

    def dequant(self, code: np.ndarray) -> np.ndarray:
        """fp32 ``code * scale + zero`` of (possibly fractional) codes ``[H, T, D]``."""
        return (code.astype(np.float32) * self.expand(self.scale) + self.expand(self.zero)).astype(np.float32)


def int8_grids(k: np.ndarray, v: np.ndarray, k_group: int = K_GROUP, v_group: int = V_GROUP) -> tuple[Grid, Grid]:
    """The codec's plain INT8 encoding of one layer, read back as NumPy codes/scales."""
    enc = encode_layer(np.ascontiguousarray(k, np.float32), np.ascontiguousarray(v, np.float32),
                       CodecConfig(scheme=Scheme.INT8, k_group=k_group, v_group=v_group))
    buf = np.asarray(next(iter(enc.buffers.values())))

    def region(name: str, dtype: type) -> np.ndarray:
        r = enc.layout.region(name)
        return buf[r.offset : r.offset + r.size].view(dtype).reshape(r.shape)

    out = []
    for kind, group in (("k", k_group), ("v", v_group)):
        out.append(Grid(region(f"{kind}_data", np.uint8).copy(),
                        region(f"{kind}_scale", np.float16).astype(np.float32),
                        region(f"{kind}_zero", np.float16).astype(np.float32), kind, group))
    return out[0], out[1]


def _grouped(x: np.ndarray, kind: str, group: int, fill: int) -> np.ndarray:
    """``x [H, T, D]`` with the group members on the last axis: K ``[H, G, D, g]``,
    V ``[H, T, G, g]`` (a partial last group padded with ``fill``)."""
    heads, tokens, dim = x.shape
    if kind == "k":
        n = -(-tokens // group) * group
        if n != tokens:
            x = np.concatenate([x, np.full((heads, n - tokens, dim), fill, x.dtype)], axis=1)
        return x.reshape(heads, n // group, group, dim).transpose(0, 1, 3, 2)
    n = -(-dim // group) * group
    if n != dim:
        x = np.concatenate([x, np.full((heads, tokens, n - dim), fill, x.dtype)], axis=2)
    return x.reshape(heads, tokens, n // group, group)


def _group_count(mask: np.ndarray, kind: str, group: int) -> np.ndarray:
    """Per element: how many members of its group have ``mask`` set (``[H, T, D]`` int32)."""
    _heads, tokens, dim = mask.shape
    counts = _grouped(mask.astype(np.int32), kind, group, 0).sum(axis=-1, dtype=np.int32)
    if kind == "k":
        return np.repeat(counts, group, axis=1)[:, :tokens]  # [H, G, D] -> [H, T, D]
    return np.repeat(counts, group, axis=2)[:, :, :dim]  # [H, T, G] -> [H, T, D]


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Tables:
    """Fitted reconstruction codes for one anchor width and one tensor kind:
    ``by_anchor[a]`` the mean 8-bit code of bin ``a``; ``low[n-1]`` / ``high[n-1]``
    the mean code of the bottom / top bin when it holds ``n`` values of its group
    (last entry: ``>= END_COUNTS``)."""

    by_anchor: np.ndarray
    low: np.ndarray
    high: np.ndarray


Rule = Callable[[np.ndarray, int, Grid, "Tables | None"], np.ndarray]


def _centre(a: np.ndarray, bits: int) -> np.ndarray:
    r = 8 - bits
    return a.astype(np.float32) * np.float32(1 << r) + np.float32(((1 << r) - 1) / 2)


def rule_centre(a: np.ndarray, bits: int, grid: Grid, tables: Tables | None = None) -> np.ndarray:
    """Code ``a * 2^r + (2^r - 1)/2``."""
    return _centre(a, bits)


def _ends(a: np.ndarray, bits: int, frac: float) -> np.ndarray:
    r, top = 8 - bits, (1 << bits) - 1
    code = _centre(a, bits)
    inset = np.float32(frac * ((1 << r) - 1))
    code[a == 0] = inset
    code[a == top] = np.float32(255) - inset
    return code


def rule_edge(a: np.ndarray, bits: int, grid: Grid, tables: Tables | None = None) -> np.ndarray:
    """Centre, but ``a == 0`` -> code 0 and ``a == 2^b - 1`` -> code 255."""
    return _ends(a, bits, 0.0)


def rule_quarter(a: np.ndarray, bits: int, grid: Grid, tables: Tables | None = None) -> np.ndarray:
    """Centre, but the end bins at a quarter of the bin from the group's edge."""
    return _ends(a, bits, 0.25)


def rule_stretch(a: np.ndarray, bits: int, grid: Grid, tables: Tables | None = None) -> np.ndarray:
    """Code ``a * 255 / (2^b - 1)``: the levels of direct b-bit quantization."""
    return a.astype(np.float32) * np.float32(255 / ((1 << bits) - 1))


def _end_counts(a: np.ndarray, bits: int, grid: Grid) -> tuple[np.ndarray, np.ndarray]:
    top = (1 << bits) - 1
    return _group_count(a == 0, grid.kind, grid.group), _group_count(a == top, grid.kind, grid.group)


def rule_occupancy(a: np.ndarray, bits: int, grid: Grid, tables: Tables | None = None) -> np.ndarray:
    """Centre, but an end bin that holds exactly one value of its group holds the
    group's extreme: code 0 (bottom) or 255 (top)."""
    top = (1 << bits) - 1
    n_low, n_high = _end_counts(a, bits, grid)
    code = _centre(a, bits)
    code[(a == 0) & (n_low == 1)] = 0.0
    code[(a == top) & (n_high == 1)] = 255.0
    return code


def rule_occ_quarter(a: np.ndarray, bits: int, grid: Grid, tables: Tables | None = None) -> np.ndarray:
    """Like ``occupancy``, but an end bin holding several values of its group is taken
    at a quarter of the bin from the group's edge (as ``quarter``)."""
    top = (1 << bits) - 1
    n_low, n_high = _end_counts(a, bits, grid)
    code = _ends(a, bits, 0.25)
    code[(a == 0) & (n_low == 1)] = 0.0
    code[(a == top) & (n_high == 1)] = 255.0
    return code


def occ_mean_inset(n: np.ndarray, bits: int) -> np.ndarray:
    """fp32 inset from the group's edge of an end bin holding ``n >= 1`` values:
    ``(n - 1) * (2^r - 1) / (2 n)``, as one correctly rounded fp32 division of two
    exact integers (so NumPy, Numba and CUDA agree bit for bit)."""
    n = np.asarray(n, np.int32)
    return ((n - 1) * ((1 << (8 - bits)) - 1)).astype(np.float32) / (2 * n).astype(np.float32)


def rule_occ_mean(a: np.ndarray, bits: int, grid: Grid, tables: Tables | None = None) -> np.ndarray:
    """An end bin holding ``n`` values of its group: ``(edge + (n - 1) * centre) / n``
    (one of them is the group's extreme, exactly at the edge; the others taken at
    the bin centre), i.e. code ``inset(n)`` for ``a == 0`` and ``255 - inset(n)``
    for ``a == 2^b - 1`` (:func:`occ_mean_inset`); interior bins at the centre."""
    top = (1 << bits) - 1
    n_low, n_high = _end_counts(a, bits, grid)
    code = _centre(a, bits)
    low, high = a == 0, a == top
    code[low] = occ_mean_inset(n_low[low], bits)
    code[high] = np.float32(255) - occ_mean_inset(n_high[high], bits)
    return code


def rule_table(a: np.ndarray, bits: int, grid: Grid, tables: Tables | None = None) -> np.ndarray:
    """Code ``by_anchor[a]`` (fitted conditional mean of the bin)."""
    assert tables is not None
    return tables.by_anchor[a]


def rule_table_occ(a: np.ndarray, bits: int, grid: Grid, tables: Tables | None = None) -> np.ndarray:
    """``by_anchor[a]`` inside; end bins ``low[n-1]`` / ``high[n-1]`` by occupancy."""
    assert tables is not None
    top = (1 << bits) - 1
    n_low, n_high = _end_counts(a, bits, grid)
    code = tables.by_anchor[a]
    low, high = a == 0, a == top
    code[low] = tables.low[np.clip(n_low[low], 1, END_COUNTS) - 1]
    code[high] = tables.high[np.clip(n_high[high], 1, END_COUNTS) - 1]
    return code


RULES: Mapping[str, Rule] = {
    "centre": rule_centre,
    "edge": rule_edge,
    "quarter": rule_quarter,
    "stretch": rule_stretch,
    "occupancy": rule_occupancy,
    "occ-quarter": rule_occ_quarter,
    "occ-mean": rule_occ_mean,
    "table": rule_table,
    "table-occ": rule_table_occ,
}
FITTED = ("table", "table-occ")


def reconstruct(grid: Grid, bits: int, rule: str, tables: Tables | None = None) -> np.ndarray:
    """fp32 ``[H, T, D]`` rebuilt from the top ``bits`` of the INT8 codes by ``rule``."""
    a = grid.codes >> np.uint8(8 - bits)
    return grid.dequant(RULES[rule](a, bits, grid, tables))


def fit_tables(layers: Sequence[Layer], bits: int) -> dict[str, Tables]:
    """Fit ``table``/``table-occ`` codes (per kind) on the INT8 codes of ``layers``:
    the mean code of each bin, and of each end bin by its occupancy in the group."""
    top = (1 << bits) - 1
    sums = {kind: np.zeros((3, max(top + 1, END_COUNTS)), np.float64) for kind in "kv"}
    counts = {kind: np.zeros_like(sums[kind]) for kind in "kv"}
    for k, v in layers:
        for grid in int8_grids(k, v):
            q = grid.codes.astype(np.float64)
            a = grid.codes >> np.uint8(8 - bits)
            s, c = sums[grid.kind], counts[grid.kind]
            np.add.at(s[0], a.ravel(), q.ravel())
            np.add.at(c[0], a.ravel(), 1)
            n_low, n_high = _end_counts(a, bits, grid)
            for row, mask, n in ((1, a == 0, n_low), (2, a == top, n_high)):
                idx = np.clip(n[mask], 1, END_COUNTS) - 1
                np.add.at(s[row], idx, q[mask])
                np.add.at(c[row], idx, 1)
    out = {}
    centre = _centre(np.arange(top + 1, dtype=np.uint8), bits).astype(np.float64)
    for kind in "kv":
        s, c = sums[kind], counts[kind]
        mean = np.divide(s, c, out=np.zeros_like(s), where=c > 0)
        by_anchor = np.where(c[0, : top + 1] > 0, mean[0, : top + 1], centre)
        low = np.where(c[1, :END_COUNTS] > 0, mean[1, :END_COUNTS], centre[0])
        high = np.where(c[2, :END_COUNTS] > 0, mean[2, :END_COUNTS], centre[top])
        out[kind] = Tables(by_anchor.astype(np.float32), low.astype(np.float32), high.astype(np.float32))
    return out


# --------------------------------------------------------------------------- schemes


def direct_quant(x: np.ndarray, kind: str, group: int, levels: int) -> np.ndarray:
    """Direct asymmetric quantization with ``levels`` steps over each group's
    ``[min, max]`` (fp32, round to nearest), dequantized: INT3 = 7, INT2 = 3."""
    g = _grouped(np.ascontiguousarray(x, np.float32), kind, group, 0)
    if x.shape[1 if kind == "k" else 2] % group:
        raise ValueError("direct_quant needs whole groups")
    lo, hi = g.min(axis=-1, keepdims=True), g.max(axis=-1, keepdims=True)
    scale = (hi - lo) / np.float32(levels)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint((g - lo) / safe), 0, levels)
    y = (q * scale + lo).astype(np.float32)
    heads, tokens, dim = x.shape
    if kind == "k":
        return np.ascontiguousarray(y.transpose(0, 1, 3, 2).reshape(heads, tokens, dim))
    return np.ascontiguousarray(y.reshape(heads, tokens, dim))


def _codec(config: CodecConfig, anchor_only: bool) -> SchemeFn:
    def run(k: np.ndarray, v: np.ndarray) -> Layer:
        return codec_layers([(k, v)], config, (1 if anchor_only else None,))[0][0]

    return run


def _bf16(k: np.ndarray, v: np.ndarray) -> Layer:
    def cast(x: np.ndarray) -> np.ndarray:
        u = np.ascontiguousarray(x, np.float32).view(np.uint32)
        u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        return u.view(np.float32)

    return cast(k), cast(v)


def _anchor(bits: int, rule: str, tables: Mapping[str, Tables] | None) -> SchemeFn:
    def run(k: np.ndarray, v: np.ndarray) -> Layer:
        gk, gv = int8_grids(k, v)
        return (reconstruct(gk, bits, rule, None if tables is None else tables["k"]),
                reconstruct(gv, bits, rule, None if tables is None else tables["v"]))

    return run


def _direct(levels: int) -> SchemeFn:
    def run(k: np.ndarray, v: np.ndarray) -> Layer:
        return direct_quant(k, "k", K_GROUP, levels), direct_quant(v, "v", V_GROUP, levels)

    return run


def build_schemes(bits: Sequence[int], rules: Sequence[str],
                  tables: Mapping[int, Mapping[str, Tables]] | None = None, *,
                  extra_bits: Sequence[int] = (), extra_rules: Sequence[str] = ()) -> dict[str, SchemeFn]:
    """Scheme name -> layer transform: baselines, then per anchor width ``b`` in
    ``bits``: each rule (``b4/centre``, ...), ``b4/rounded`` (anchor-only) and
    ``b4/rounded-full``; then per width in ``extra_bits`` each of ``extra_rules``
    (no ROUNDED). Fitted rules are skipped when ``tables`` lacks the width."""
    out: dict[str, SchemeFn] = {
        "fp32": lambda k, v: (k, v),
        "bf16": _bf16,
        "int8": _codec(CodecConfig(scheme=Scheme.INT8), False),
        "int4": _codec(CodecConfig(scheme=Scheme.INT4), False),
        "int3": _direct(7),
        "int2": _direct(3),
    }
    def add_rules(b: int, these: Sequence[str]) -> None:
        fitted = None if tables is None else tables.get(b)
        for rule in these:
            if rule in FITTED and fitted is None:
                continue
            out[f"b{b}/{rule}"] = _anchor(b, rule, fitted if rule in FITTED else None)

    for b in bits:
        add_rules(b, rules)
        rounded = CodecConfig(scheme=Scheme.LYNX, bits=b, split=Split.ROUNDED)
        out[f"b{b}/rounded"] = _codec(rounded, True)
        out[f"b{b}/rounded-full"] = _codec(rounded, False)
    for b in extra_bits:
        add_rules(b, extra_rules)
    return out


# --------------------------------------------------------------------------- measurement


@dataclass
class Metrics:
    """One scheme on one text: top-1 agreement with the fp32 cache and mean
    ``KL(fp32 || scheme)`` over the ``M`` teacher-forced positions, and speculative
    acceptance against the INT8 cache's greedy drafts per draft length ``k``."""

    agreement: float
    kl: float
    acceptance: dict[int, float] = field(default_factory=dict)
    starts: int = 0


def _kv_cache(layers: Sequence[Layer], headroom: int) -> KVBuffers:
    return KVBuffers.from_layers([k for k, _ in layers], [v for _, v in layers], headroom=headroom)


def _start_positions(m: int, count: int, kmax: int) -> list[int]:
    """``count`` positions spread over ``[0, m - kmax]``, descending (each start's drafts
    overwrite only the cache positions after it)."""
    last = m - kmax
    picks = {round(i * last / max(count - 1, 1)) for i in range(count)}
    return sorted(picks, reverse=True)


def evaluate_text(model: HFCausalLM, ids: Sequence[int], schemes: Mapping[str, SchemeFn], *, prompt: int = 2048,
                  steps: int = 128, starts: int = 32, drafts: Sequence[int] = (2, 4, 8),
                  progress: Callable[[str], None] | None = None) -> dict[str, Metrics]:
    """Metrics of every scheme on one text (``ids`` needs ``prompt + steps`` tokens).

    The fp32 reference and the INT8 verifier are run once; ``schemes`` may include
    ``int8`` (its acceptance is 1 by construction)."""
    ids = [int(t) for t in ids]
    if len(ids) < prompt + steps:
        raise ValueError(f"need {prompt + steps} tokens, got {len(ids)}")
    kmax = max(drafts)
    pre = model.prefill(ids[: prompt + 1])  # caches ids[:prompt]
    ref_layers = [(np.array(pre.kv.keys[i]), np.array(pre.kv.values[i])) for i in range(pre.kv.shape.num_layers)]
    cont = ids[prompt : prompt + steps]  # logits[j] predicts ids[prompt + j + 1]
    positions = _start_positions(steps, starts, kmax)

    def teacher(layers: Sequence[Layer]) -> tuple[np.ndarray, KVBuffers, SlabCache]:
        kv = _kv_cache(layers, steps + kmax + 8)
        cache = model.cache_from(kv)
        return model.forward(cache, cont), kv, cache

    ref_logits, _, _ = teacher(ref_layers)

    # the INT8 verifier's greedy continuation from every start
    int8_layers = [schemes["int8"](k, v) if "int8" in schemes else _codec(CodecConfig(scheme=Scheme.INT8), False)(k, v)
                   for k, v in ref_layers]
    int8_logits, _, cache8 = teacher(int8_layers)
    greedy: dict[int, list[int]] = {}
    for j in positions:
        cache8.crop(prompt + j + 1)
        seq = [int(int8_logits[j].argmax())]
        for _ in range(kmax - 1):
            seq.append(int(model.forward(cache8, [seq[-1]])[-1].argmax()))
        greedy[j] = seq

    out: dict[str, Metrics] = {}
    for name, fn in schemes.items():
        t0 = time.perf_counter()
        layers = [fn(k, v) for k, v in ref_layers]
        logits, _, cache = teacher(layers)
        kl = kl_divergence(ref_logits, logits)
        agree = top1_agreement(ref_logits, logits)
        accepted = {k: 0 for k in drafts}
        for j in positions:
            cache.crop(prompt + j + 1)
            g = greedy[j]
            step = model.forward(cache, g[: kmax - 1])
            draft = [int(logits[j].argmax()), *(int(t) for t in step.argmax(axis=-1))]
            run = next((i for i, (d, w) in enumerate(zip(draft, g)) if d != w), kmax)
            for k in drafts:
                accepted[k] += min(run, k)
        acc = {k: accepted[k] / (k * len(positions)) for k in drafts}
        out[name] = Metrics(agree, kl, acc, len(positions))
        if progress is not None:
            progress(f"{name}: agree {agree:.3f} kl {kl:.4f} acc@{kmax} {acc[kmax]:.3f} "
                     f"({time.perf_counter() - t0:.1f} s)")
    return out


# --------------------------------------------------------------------------- CLI


def _table(results: Mapping[str, Mapping[str, Metrics]], drafts: Sequence[int]) -> str:
    texts = list(results)
    names = list(next(iter(results.values())))
    head = f"{'scheme':<20}" + "".join(f"{t[:9]:>10}" for t in texts) + f"{'mean':>10}"
    lines = []
    def acceptance(k: int) -> Callable[[Metrics], float]:
        return lambda m: m.acceptance.get(k, math.nan)

    for title, get in [("top-1 agreement with fp32", lambda m: m.agreement),
                       ("mean KL(fp32 || scheme), nats", lambda m: m.kl),
                       *[(f"acceptance@{k} vs INT8 greedy", acceptance(k)) for k in drafts]]:
        lines += ["", title, head]
        for name in names:
            vals = [get(results[t][name]) for t in texts]
            fmt = "{:>10.4f}" if "KL" in title else "{:>10.3f}"
            lines.append(f"{name:<20}" + "".join(fmt.format(x) for x in vals) + fmt.format(float(np.mean(vals))))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every scheme on every text and print the tables."""
    p = argparse.ArgumentParser(prog="python experiments/anchor_quality.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", default=",".join(EVAL_TEXTS))
    p.add_argument("--fit-text", default=FIT_TEXT, help="held-out text the fitted tables are learned on")
    p.add_argument("--bits", default="4,3,2")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--extra-bits", default="5,6,7", help="more anchor widths, with --extra-rules only")
    p.add_argument("--extra-rules", default="centre,edge,occupancy,occ-quarter,occ-mean")
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--starts", type=int, default=32)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # before torch loads
    bits = [int(b) for b in args.bits.split(",") if b]
    rules = [r for r in args.rules.split(",") if r]
    extra_bits = [int(b) for b in args.extra_bits.split(",") if b]
    extra_rules = [r for r in args.extra_rules.split(",") if r]
    t0 = time.perf_counter()
    model = HFCausalLM.load()
    tables = None
    if any(r in FITTED for r in (*rules, *extra_rules)):
        fit_ids = model.tokenize(load_texts([args.fit_text])[args.fit_text])[: args.prompt + 1]
        pre = model.prefill(fit_ids)
        layers = [(pre.kv.keys[i], pre.kv.values[i]) for i in range(pre.kv.shape.num_layers)]
        tables = {b: fit_tables(layers, b) for b in (*bits, *extra_bits)}
    schemes = build_schemes(bits, rules, tables, extra_bits=extra_bits, extra_rules=extra_rules)
    results: dict[str, dict[str, Metrics]] = {}
    for name, text in load_texts(args.texts.split(",")).items():
        ids = model.tokenize(text)[: args.prompt + args.steps + 1]
        say = None if args.quiet else (lambda s, name=name: print(f"[{name}] {s}", flush=True))
        results[name] = evaluate_text(model, ids, schemes, prompt=args.prompt, steps=args.steps, starts=args.starts,
                                      progress=say)
    print(_table(results, (2, 4, 8)))
    if tables is not None:
        print("\nfitted tables (8-bit codes), fitted on", args.fit_text)
        for b, per in tables.items():
            for kind, t in per.items():
                print(f"b{b} {kind}: by_anchor {np.round(t.by_anchor, 2).tolist()} "
                      f"low(n=1..{END_COUNTS}+) {np.round(t.low, 2).tolist()} high {np.round(t.high, 2).tolist()}")
    print(f"\nrun time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
