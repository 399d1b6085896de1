"""Arithmetic and code generation for the numba kernels (imported only when numba is installed):
``fma(a, b, c)``, ``a * b + c`` rounded once; ``set_llvm_optsize()``, size-optimising
instruction selection for the calling kernel (float32 inputs converted straight from memory);
``lanes(x, rows)``, the four rows a kernel runs at once (docs/design/scan.md).
"""

import numba
from numba.core import types
from numba.extending import intrinsic

__all__ = ["fma", "lanes", "set_llvm_optsize"]


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
