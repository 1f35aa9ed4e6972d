"""Shared hypothesis strategies for the codec tests: random layers that exercise
partial groups, constant groups, large offsets relative to the range, and every
supported dtype, plane split and grid split."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from lynx_decode.codec.config import CodecConfig, Scheme, Split


@dataclass(frozen=True)
class Case:
    k: np.ndarray  # fp32 values (what the codec sees after widening)
    v: np.ndarray
    dtype: str  # "float32" | "float16" | "bfloat16"
    config: CodecConfig

    def inputs(self):
        """(K, V) in the case's dtype: NumPy for fp32/fp16, torch tensors for bf16."""
        if self.dtype == "bfloat16":
            import torch

            return torch.from_numpy(self.k).to(torch.bfloat16), torch.from_numpy(self.v).to(torch.bfloat16)
        return self.k.astype(self.dtype), self.v.astype(self.dtype)

    def exact_inputs(self):
        """The fp32 values the codec actually receives (after the dtype's rounding)."""
        if self.dtype == "bfloat16":
            k, v = self.inputs()
            return k.float().numpy(), v.float().numpy()
        k, v = self.inputs()
        return k.astype(np.float32), v.astype(np.float32)


def _values(rng: np.random.Generator, shape: tuple[int, ...], kind: int) -> np.ndarray:
    if kind == 0:
        x = rng.standard_normal(shape)
    elif kind == 1:  # outlier channels, like real K
        x = rng.standard_normal(shape) * rng.choice([0.1, 1.0, 20.0], size=(1, 1, shape[2]))
    elif kind == 2:  # narrow range far from zero: stresses the fp16 zero point
        x = 300.0 + rng.standard_normal(shape) * 1e-3
    elif kind == 3:  # constant tensor
        x = np.full(shape, rng.standard_normal())
    elif kind == 4:  # tiny values: fp16 subnormal scales
        x = rng.standard_normal(shape) * 1e-6
    else:  # signed zeros (reduction order must not leak into the zero point) and a few values
        x = rng.choice(np.array([0.0, -0.0, 0.0, -0.0, 1.5]), size=shape)
    return x.astype(np.float32)


@st.composite
def plane_splits(draw) -> tuple[int, ...]:
    """Every valid split: an anchor of 2..6 bits, the rest cut into planes of >= 1 bit."""
    anchor = draw(st.integers(2, 6))
    cuts = draw(st.lists(st.booleans(), min_size=7 - anchor, max_size=7 - anchor))
    parts, width = [anchor], 1
    for cut in cuts:
        if cut:
            parts.append(width)
            width = 1
        else:
            width += 1
    return (*parts, width)


@st.composite
def cases(draw, schemes=(Scheme.LYNX,), max_tokens: int = 150) -> Case:
    heads = draw(st.integers(1, 3))
    tokens = draw(st.integers(1, max_tokens))
    dim = draw(st.sampled_from([1, 7, 16, 33, 64, 80]))
    config = CodecConfig(
        scheme=draw(st.sampled_from(schemes)),
        planes=draw(st.one_of(plane_splits(), st.integers(2, 6).map(lambda b: (b, 8 - b)))),
        k_group=draw(st.sampled_from([1, 3, 16, 64, 100])),
        v_group=draw(st.sampled_from([1, 5, 32, 64, 128])),
        split=draw(st.sampled_from(list(Split))),
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.integers(0, 5))
    shape = (heads, tokens, dim)
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    return Case(_values(rng, shape, kind), _values(rng, shape, kind), dtype, config)
