"""Exact arithmetic for the compiled kernels (numba; imported only when installed).

``fma(a, b, c)`` is ``a * b + c`` with one rounding: the float64 carries of the kernels advance
by one fused multiply-add per step, so their latency chain is no longer than a float32 one.
"""

from numba.extending import intrinsic

__all__ = ["fma"]


@intrinsic
def fma(typingctx, a, b, c):
    """``a * b + c`` with one rounding (the hardware instruction where the CPU has one)."""

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return a(a, b, c), codegen
