"""Arithmetic and code generation for the numba kernels (imported only when numba is installed):
``fma(a, b, c)``, ``a * b + c`` rounded once; ``set_llvm_optsize()``, size-optimising
instruction selection for the calling kernel (float32 inputs converted straight from memory);
``lanes(x, rows)``, the four rows a kernel runs at once, ``group(g, n)`` the rows of group
``g`` of ``n``; ``load(x, t)``, ``narrow(o, v)`` and ``store(o, t, v)``, an element in a kernel's
arithmetic dtype, bfloat16 arrays held as their ``uint16`` bits and computed in float32
(docs/design/scan.md).
"""

import numba
import numpy as np
from numba.core import types
from numba.extending import intrinsic, overload

__all__ = ["fma", "group", "lanes", "load", "narrow", "set_llvm_optsize", "store"]


@intrinsic
def fma(typingctx, a, b, c):
    """``a * b + c`` with one rounding (the hardware instruction where the CPU has one)."""

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return a(a, b, c), codegen


@intrinsic
def set_llvm_optsize(typingctx):
    """Compile the calling kernel with size-optimising instruction selection (see above)."""

    def codegen(context, builder, signature, args):
        builder.function.attributes.add("optsize")
        return context.get_dummy_value()

    return types.void(), codegen


@numba.njit(inline="always")
def lanes(x, rows):
    """``x[rows[0]], ..., x[rows[3]]``: the four rows a kernel runs at once."""
    i0, i1, i2, i3 = rows
    return x[i0], x[i1], x[i2], x[i3]


@numba.njit(inline="always")
def group(g, n):
    """The four rows of group ``g`` of ``n`` rows; a short last group repeats its last row."""
    r = 4 * g
    return r, min(r + 1, n - 1), min(r + 2, n - 1), min(r + 3, n - 1)


def _bits(x) -> bool:
    return isinstance(x, types.Array) and x.dtype == types.uint16


def load(x, t):
    """``x[t]`` in the arithmetic dtype (the float32 a bfloat16's bits stand for: exact)."""


def narrow(o, v):
    """``v`` rounded once to the arithmetic dtype of ``o`` (float32 for bfloat16 bits)."""


def store(o, t, v):
    """``o[t] = v``, ``v`` in the arithmetic dtype; into bfloat16 bits rounded to nearest even
    (NaN a quiet NaN), as torch rounds a float32."""


@overload(load, inline="always")
def _load(x, t):
    if _bits(x):
        return lambda x, t: np.uint32(np.uint32(x[t]) << np.uint32(16)).view(np.float32)
    return lambda x, t: x[t]


@overload(narrow, inline="always")
def _narrow(o, v):
    if _bits(o):
        return lambda o, v: np.float32(v)
    return lambda o, v: o.dtype.type(v)


@overload(store, inline="always")
def _store(o, t, v):
    if not _bits(o):

        def plain(o, t, v):
            o[t] = v

        return plain

    def bf16(o, t, v):
        o[t] = _bf16_bits(v)

    return bf16


@numba.njit(inline="always")
def _bf16_bits(v):
    # float32 to bfloat16 bits, to nearest even; a NaN is the quiet NaN (a select, no branch)
    b = np.int64(np.float32(v).view(np.uint32))
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return np.uint16(rounded + np.int64(v != v) * (0x7FC0 - rounded))
