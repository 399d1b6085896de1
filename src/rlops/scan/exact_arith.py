"""Arithmetic and code generation for the compiled kernels (numba; imported only when installed).

``fma(a, b, c)`` is ``a * b + c`` with one rounding: the float64 carries of the kernels advance
by one fused multiply-add per step, so their latency chain is no longer than a float32 one.

``set_llvm_optsize()`` marks the kernel that calls it for LLVM's size-optimising instruction
selection, for one effect: a float32 input is then converted to float64 straight from memory
(``vcvtss2sd m32`` on x86: a load and one arithmetic micro-op). For speed LLVM otherwise loads
it first and converts the register, which costs an extra shuffle-port micro-op; with two
conversions per token on that port (the input, and the output's rounding) the float64 carry
was then bound by that port rather than by the carry's latency. The kernels are single loops,
so the unrolling that size optimisation gives up is not missed.

``lanes(x, rows)`` is the four rows ``rows`` of ``x`` (views, or the numbers of a 1-D ``x``):
every kernel runs four rows at once, four independent carry chains, and reads its inputs as
``x0, x1, x2, x3 = lanes(x, rows)``.
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
