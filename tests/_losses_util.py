"""Shared helpers of the statistics, group-estimator and loss tests."""

from __future__ import annotations

import torch
from tests.tolerances import assert_error_within

__all__ = ["DTYPES", "acc_dtype", "assert_within_ref_error", "make_inputs", "random_mask"]

DTYPES = [torch.bfloat16, torch.float32, torch.float64]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype rlops accumulates in (and a same-dtype reference should too)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def random_mask(b: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """Response masks of random length with an interior 0-span per row; row 0 has no token."""
    mask = torch.zeros(b, t, dtype=torch.long)
    for i in range(1, b):
        n = int(torch.randint(1, t + 1, (1,), generator=gen))
        mask[i, :n] = 1
        if n > 4:
            s = int(torch.randint(1, n - 2, (1,), generator=gen))
            mask[i, s : s + int(torch.randint(1, 3, (1,), generator=gen))] = 0
    return mask


def make_inputs(dtype, seed, b=6, t=29, spread=0.3):
    """``(logp, old_logp, advantages, mask)`` for the loss tests: old log-probs in [−3, 0],
    ``logp`` off them by ``spread``·N(0, 1), standard-normal advantages (all drawn in float64,
    then cast to ``dtype``) and a :func:`random_mask`."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    logp = old + spread * torch.randn(b, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
    return logp.to(dtype), old.to(dtype), adv.to(dtype), random_mask(b, t, gen)


def assert_within_ref_error(out, exact, ref_same, scale=0.0):
    """The suite's rule (``tests.tolerances``): ``|out − exact| ≤ 2·|same-dtype reference −
    exact|`` plus a few ulps of ``out``'s dtype at the output's magnitude.

    ``exact`` is computed in rational or 40-digit arithmetic and rounded once to float64, so
    float64 outputs have a measurable reference error. ``ref_same`` is a plain loop in the
    accumulation dtype (rounded to the output dtype). For a reduction, ``scale`` is the same
    reduction of the terms' magnitudes (Σ|ℓ| / normaliser): rounding each term in ``out``'s dtype
    can move a sum with cancellation by ``eps·scale`` however accurate the summation.
    """
    err = float((out.double() - exact).abs().max())
    ref_err = float((ref_same.double() - exact).abs().max())
    magnitude = max(float(exact.abs().max()), float(scale))
    assert_error_within("result", err, ref_err, out.dtype, magnitude)
