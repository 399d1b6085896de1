"""The suite's one tolerance rule, measured from a reference's own error: no fixed atol anywhere.

**The rule** (:func:`error_bound`, used by every error comparison in the suite):

    err(out) <= factor * err(ref) + FLOOR_ULPS * ulp(dtype, magnitude)

``err`` is the max abs error against an exact oracle (float64, or ``numpy.longdouble`` for
float64 results), ``ref`` the plain same-dtype reference on the same inputs, ``factor`` 2
unless a test says why not (3 for gradients of the log-prob ops: two roundings of ``p``), and
the floor is ``FLOOR_ULPS`` = 4 ulps, in the output's dtype, of the magnitude of the values the
result is made of (the largest ``|oracle|`` by default; the terms' magnitude where the result
cancels, e.g. the scan of ``|x|``).

Why a floor. Twice the reference's error is a fair bound only while that error is a typical
one. Where the reference happens to be nearly exact (a one-term sum, as at top_k = 1; a lucky
rounding; a float64 oracle that reproduces the float64 loop bit for bit), a fast path that
sums in another order, or whose matmul kernel (chosen by the CPU's dispatch: AVX2, AVX-512,
the default build) rounds differently, lands a few roundings from the exact value and is just
as correct. Each of the result's terms, rounded once in ``dtype``, may move the result by
half an ulp of the terms' magnitude; a log-prob ``z_y − lse(z)`` or an entropy has a handful
of such roundings beyond the reference's, hence 4 ulps. The floor is a few ulps of the values,
so it never hides an error that grows with the length or the vocabulary: those are what
``factor * err(ref)`` measures.

The comparisons of the suite apply the rule through thin adapters that differ only in the
data they take: :func:`assert_within_reference` (outputs and oracles as tensors or longdouble
arrays), ``tests._logprobs_util.assert_as_accurate`` and ``assert_as_accurate_as_float64``,
``tests._losses_util.assert_within_ref_error``; :func:`assert_half_matches` for bfloat16 and
float16 outputs (the float32 rule plus one half-dtype ulp).

The scan tests' particulars:


* Full-precision dtypes (float32, float64): a method's max abs error against the oracle must be
  at most twice the error of the serial reference (``method="reference"``) in the same dtype on
  the same inputs — and, for float32 on the compiled and auto paths, at most twice the error
  of the chunked form where that is the more accurate (the default path must not be less
  accurate than the best blocked summation we ship; its float64 carry makes that free; a
  float64 input has no wider carry, so there the serial reference's error is the rule) — plus
  a floor of a few ulps of the output's magnitude for inputs on which the reference happens to
  be exact. For float64 outputs the oracle must be the extended-precision one (a float64
  oracle reproduces the float64 serial loop bit for bit, so the reference's measured error
  would be 0); where no wider type exists, float64 falls back to ``serial_bound``.
* Half dtypes (bfloat16, float16) accumulate in float32: the output must match the float32
  serial reference rounded to the half dtype within one half-dtype ulp of each element, plus
  the float32 error budget above (the two float32 results may differ by that much before
  rounding).
* ``serial_bound``: the a priori forward-error bound of the serial loop itself, used to check
  the reference (and identities computed in float64) without comparing a method to itself.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import numpy as np
import pytest
import torch

__all__ = [
    "ALL_METHODS",
    "FAST_METHODS",
    "FLOOR_ULPS",
    "METHODS",
    "abs_diff",
    "assert_error_within",
    "assert_half_matches",
    "assert_within_bound",
    "assert_within_reference",
    "error_bound",
    "for_each_method",
    "max_abs_err",
    "needs_numba",
    "serial_bound",
    "ulp",
    "ulp_at",
]

FLOOR_ULPS = 4

# parametrisations: every method, or the fast ones, skipping "compiled" without numba
needs_numba = pytest.mark.skipif(
    importlib.util.find_spec("numba") is None, reason="method='compiled' needs numba"
)
METHODS = ["reference", "chunked", pytest.param("compiled", marks=needs_numba), "auto"]
FAST_METHODS = ["chunked", pytest.param("compiled", marks=needs_numba), "auto"]

# every method, less "compiled" where numba is not installed
ALL_METHODS = ["reference", "chunked", "compiled", "auto"]
if importlib.util.find_spec("numba") is None:
    ALL_METHODS.remove("compiled")


def for_each_method(check: Callable[[str], None]) -> None:
    """Run ``check(method)`` for every method and fail once, listing every failing method
    (one test item per case rather than per method keeps thousands of cases cheap)."""
    failures = []
    for method in ALL_METHODS:
        try:
            check(method)
        except AssertionError as e:
            failures.append(f"[method={method}] {e}")
    assert not failures, "\n".join(failures)


Oracle = torch.Tensor | np.ndarray  # float64 tensor, or a longdouble array (extended oracle)


def _np(t: Oracle, like: Oracle | None = None) -> np.ndarray:
    """``t`` as numpy, in the oracle's precision when ``like`` is a longdouble array."""
    a = t.detach().cpu().double().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    wide = isinstance(like, np.ndarray) and like.dtype == np.longdouble
    return a.astype(np.longdouble) if wide else a


def abs_diff(out: torch.Tensor, oracle: Oracle) -> np.ndarray:
    """``|out - oracle|`` elementwise in the oracle's precision; NaN becomes inf."""
    diff = np.abs(_np(out, oracle) - _np(oracle, oracle))
    return np.where(np.isnan(diff), np.inf, diff)


def max_abs_err(out: torch.Tensor, oracle: Oracle) -> float:
    """Max abs difference from the oracle; NaN or inf anywhere counts as an infinite error."""
    return float(abs_diff(out, oracle).max()) if out.numel() else 0.0


def _magnitude(t: Oracle) -> float:
    a = _np(t)
    return float(np.abs(a).max()) if a.size else 0.0


def assert_within_reference(
    name: str,
    out: torch.Tensor,
    oracle: Oracle,
    ref_out: torch.Tensor,
    magnitude: Oracle | None = None,
    chunked_out: torch.Tensor | None = None,
) -> tuple[float, float]:
    """``err(out) <= 2 * err(ref_out) + floor``, errors measured against the oracle; with
    ``chunked_out`` (the chunked method's output) and float32, ``err(ref_out)`` is replaced by
    the smaller of the two errors.

    ``out`` and ``ref_out`` share a dtype (float32 or float64). The floor is ``FLOOR_ULPS``
    ulps of the largest ``|oracle|``, or of the largest ``magnitude`` when given (property
    tests pass the scan of ``|x|``: with arbitrary inputs the output may cancel to far below
    its terms). Returns ``(err, ref_err)``.
    """
    assert out.dtype == ref_out.dtype, (out.dtype, ref_out.dtype)
    assert tuple(out.shape) == tuple(oracle.shape), (out.shape, oracle.shape)
    err = max_abs_err(out, oracle)
    ref_err = max_abs_err(ref_out, oracle)
    what = f"serial {out.dtype} reference's"
    float32 = out.dtype == torch.float32
    if chunked_out is not None and float32 and max_abs_err(chunked_out, oracle) < ref_err:
        ref_err, what = max_abs_err(chunked_out, oracle), f"chunked {out.dtype} form's"
    scale = _magnitude(oracle if magnitude is None else magnitude)
    assert_error_within(name, err, ref_err, out.dtype, scale, what=what)
    return err, ref_err


def error_bound(ref_err: float, dtype: torch.dtype, magnitude: float, factor: float = 2.0) -> float:
    """The rule (module docstring): ``factor * ref_err + FLOOR_ULPS`` ulps of ``dtype`` at
    ``magnitude``."""
    return factor * ref_err + FLOOR_ULPS * ulp_at(dtype, magnitude)


def assert_error_within(
    name: str,
    err: float,
    ref_err: float,
    dtype: torch.dtype,
    magnitude: float,
    factor: float = 2.0,
    what: str = "same-dtype reference's",
) -> None:
    """``err <= error_bound(ref_err, dtype, magnitude, factor)``, with a message that names
    both errors and the floor."""
    bound = error_bound(ref_err, dtype, magnitude, factor)
    assert err <= bound, (
        f"{name}: max abs error {err:.4g} against the exact result exceeds {factor:g} x the "
        f"{what} {ref_err:.4g} + a floor of {FLOOR_ULPS} {dtype} ulps at {magnitude:.4g} "
        f"(bound {bound:.4g})"
    )


def ulp_at(dtype: torch.dtype, magnitude: float) -> float:
    """An upper bound on the ulp of ``dtype`` at ``magnitude``: ``eps * magnitude``, and never
    below the spacing of subnormals (``smallest_normal * eps``)."""
    info = torch.finfo(dtype)
    return info.eps * max(magnitude, info.smallest_normal)


def ulp(dtype: torch.dtype, magnitude: torch.Tensor) -> torch.Tensor:
    """Elementwise ulp of ``dtype`` at ``magnitude`` (normal range), as float64."""
    bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24, torch.float64: 53}[dtype]
    _, exponent = torch.frexp(magnitude.double())
    return torch.pow(2.0, (exponent - bits).double())


def assert_half_matches(
    name: str,
    out: torch.Tensor,
    ref32: torch.Tensor,
    oracle: Oracle,
) -> None:
    """A half-dtype ``out`` vs the float32 serial reference ``ref32`` rounded to that dtype.

    Allowed per element: one half-dtype ulp at the element's magnitude (the two float32 values
    may round to neighbouring half values), plus the float32 budget ``3 * err(ref32) + floor``
    (``out`` was accumulated in float32 and may sit ``2 * err + floor`` from the oracle, which
    sits ``err`` from ``ref32``).
    """
    assert ref32.dtype == torch.float32
    assert tuple(out.shape) == tuple(oracle.shape), (out.shape, oracle.shape)
    if out.numel() == 0:
        return
    got = out.detach().cpu().double()
    expected = ref32.to(out.dtype).double()
    ref_err = max_abs_err(ref32, oracle)
    floor = FLOOR_ULPS * ulp_at(torch.float32, _magnitude(oracle))
    tol = ulp(out.dtype, torch.maximum(got.abs(), expected.abs())) + 3 * ref_err + floor
    diff = torch.nan_to_num((got - expected).abs(), nan=float("inf"))
    worst = int((diff - tol).argmax())
    assert float((diff - tol).max()) <= 0, (
        f"{name}: {out.dtype} output differs from the float32 reference rounded to "
        f"{out.dtype} by {float(diff.flatten()[worst]):.4g} at flat index {worst} "
        f"(allowed {float(tol.flatten()[worst]):.4g}: 1 ulp + float32 budget)"
    )


def serial_bound(steps: int, dtype: torch.dtype, abs_oracle: Oracle) -> np.ndarray:
    """Forward-error bound of the serial loop run in ``dtype``, elementwise.

    ``abs_oracle`` is the exact scan of ``|x|`` (every term counted with its magnitude). Each
    step rounds one product and one sum, and a discount given in float64 is rounded once to
    ``dtype``, so each term carries at most ``3 * steps`` relative roundings:
    ``|err| <= gamma_{3 steps} * abs_oracle`` with ``gamma_n = n u / (1 - n u)``. Underflow
    adds at most half a subnormal spacing per rounding, ``n`` of them in all.
    """
    info = torch.finfo(dtype)
    u = info.eps / 2
    n = 3 * max(steps, 1)
    underflow = n * info.smallest_normal * info.eps / 2
    return (n * u / (1 - n * u)) * _np(abs_oracle) + underflow


def assert_within_bound(name: str, out: torch.Tensor, oracle: Oracle, bound: np.ndarray) -> None:
    """``|out - oracle| <= bound`` elementwise (NaN fails)."""
    if out.numel() == 0:
        return
    diff = abs_diff(out, oracle)
    worst = int(np.argmax(diff - bound))
    assert (diff <= bound).all(), (
        f"{name}: error {float(diff.flat[worst]):.4g} at flat index {worst} exceeds "
        f"the bound {float(bound.flat[worst]):.4g}"
    )
