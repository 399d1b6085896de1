"""The Triton helpers shared by every kernel family (the scan, the estimators, the log-probs).

Imported only by the ``triton`` modules, which import triton themselves (the ``gpu`` extra).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def cast_to(v, ty: tl.constexpr):
    """``v`` in ``ty``, rounded to nearest even. bfloat16 is rounded on the bits (what the
    hardware conversion does; the interpreter's conversion truncates)."""
    if ty == tl.bfloat16:
        bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(v != v, v.to(tl.float32).to(tl.bfloat16), out)  # NaN stays NaN
    return v.to(ty)


def acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The accumulators' dtype: float64 if any input is float64, else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def tl_dtype(dtype: torch.dtype):
    """The Triton type of a float32 / float64 torch dtype."""
    return tl.float64 if dtype == torch.float64 else tl.float32
