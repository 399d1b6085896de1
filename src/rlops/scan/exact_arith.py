"""Error-free transformations for the compiled kernels (numba; imported only when installed).

``two_prod`` and ``two_sum`` return a rounded result and its exact rounding error, so a
kernel can carry a value in two words: the high word on the latency chain, the low word
collecting every error off it (compensated summation, Ogita, Rump and Oishi 2005).
"""

import numba
from numba.extending import intrinsic

__all__ = ["fast_two_sum", "fma", "two_prod", "two_sum"]


@intrinsic
def fma(typingctx, a, b, c):
    """``a * b + c`` with one rounding (the hardware instruction where the CPU has one)."""

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return a(a, b, c), codegen


@numba.njit(inline="always")
def two_prod(x, y):
    """``(p, err)`` with ``p = fl(x * y)`` and ``x * y = p + err`` exactly."""
    p = x * y
    return p, fma(x, y, -p)


@numba.njit(inline="always")
def two_sum(x, y):
    """``(s, err)`` with ``s = fl(x + y)`` and ``x + y = s + err`` exactly (Knuth's TwoSum:
    no ordering of |x|, |y| needed, six flops, no branch)."""
    s = x + y
    b = s - x
    return s, (x - (s - b)) + (y - b)


@numba.njit(inline="always")
def fast_two_sum(big, small):
    """``(s, err)`` with ``s = fl(big + small)``; ``err`` is the exact rounding error when
    ``|big| >= |small|`` (Dekker's Fast2Sum, three flops), and otherwise an error estimate that
    is itself off by at most one rounding of ``small``."""
    s = big + small
    return s, small - (s - big)
