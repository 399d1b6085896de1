"""Shared helpers of the statistics, group-estimator and loss tests."""

from __future__ import annotations

import torch
from tests.tolerances import assert_error_within

__all__ = [
    "BAD_LAYOUT",
    "BAD_LAYOUT_IDS",
    "DTYPES",
    "LAYOUT_IDS",
    "acc_dtype",
    "assert_within_ref_error",
    "make_inputs",
    "random_mask",
    "small_batch",
]

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


def small_batch(dtype=torch.float64):
    """``(logp, old_logp, advantages, weights, mask)`` of shape ``[3, 5]`` for the bad-input
    tests: some ratios clip; ``mask`` is 0 at ``(1, 4)`` and ``(2, 0)``."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g, dtype=dtype) - 0.1
    old = logp + 0.3 * torch.randn(3, 5, generator=g, dtype=dtype)
    adv = torch.randn(3, 5, generator=g, dtype=dtype)
    weights = 0.5 + torch.rand(3, 5, generator=g, dtype=dtype)
    mask = torch.ones(3, 5)
    mask[1, 4] = 0
    mask[2, 0] = 0
    return logp, old, adv, weights, mask


#: packed sequence ids of a ``[3, 5]`` batch with two sequence slots per row
LAYOUT_IDS = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
_IDS = LAYOUT_IDS
_LAYOUTS = "'zigzag', 'contiguous'"
#: ``(keywords, exception, the argument named, words of what it accepts)``: the layout keywords
#: (``cp_layout``, ``seq_ids``, ``seqs_per_row``, ``cp_group``) that every loss and every
#: rollout-correction function refuses alike, on a ``[3, 5]`` batch
BAD_LAYOUT = [
    ({"cp_layout": "diagonal"}, ValueError, "cp_layout", _LAYOUTS),
    ({"cp_layout": None}, ValueError, "cp_layout", _LAYOUTS),
    ({"cp_layout": 1}, ValueError, "cp_layout", _LAYOUTS),
    ({"cp_layout": 2}, ValueError, "cp_layout", _LAYOUTS),
    ({"seq_ids": _IDS.float(), "seqs_per_row": 2}, TypeError, "seq_ids", "integer tensor"),
    ({"seq_ids": _IDS.bool(), "seqs_per_row": 2}, TypeError, "seq_ids", "integer tensor"),
    ({"seq_ids": _IDS.tolist(), "seqs_per_row": 2}, TypeError, "seq_ids", "torch.Tensor"),
    ({"seq_ids": _IDS[:, :4], "seqs_per_row": 2}, ValueError, "seq_ids", "[3, 5]"),
    ({"seq_ids": _IDS[0], "seqs_per_row": 2}, ValueError, "seq_ids", "[3, 5]"),
    ({"seq_ids": _IDS + 2, "seqs_per_row": 2}, ValueError, "seq_ids", "[0, 2)"),
    ({"seq_ids": _IDS + 3, "seqs_per_row": 2}, ValueError, "seq_ids", "[0, 2)"),
    ({"seq_ids": _IDS - 1, "seqs_per_row": 2}, ValueError, "seq_ids", "[0, 2)"),
    ({"seq_ids": _IDS}, ValueError, "seqs_per_row", "number of sequence slots"),
    ({"seqs_per_row": 2}, ValueError, "seq_ids", "pass both"),
    ({"seq_ids": _IDS, "seqs_per_row": 0}, ValueError, "seqs_per_row", ">= 1"),
    ({"seq_ids": _IDS, "seqs_per_row": -2}, ValueError, "seqs_per_row", ">= 1"),
    ({"seq_ids": _IDS, "seqs_per_row": 2.0}, TypeError, "seqs_per_row", "int"),
    ({"seq_ids": _IDS, "seqs_per_row": "2"}, TypeError, "seqs_per_row", "int"),
    ({"seq_ids": _IDS, "seqs_per_row": True}, TypeError, "seqs_per_row", "int"),
    ({"seq_ids": _IDS, "seqs_per_row": False}, TypeError, "seqs_per_row", "int"),
    ({"cp_group": "world"}, TypeError, "cp_group", "ProcessGroup or None"),
    ({"cp_group": 1}, TypeError, "cp_group", "ProcessGroup or None"),
]
#: pytest ids of :data:`BAD_LAYOUT`
BAD_LAYOUT_IDS = [f"{'+'.join(k)}-{i}" for i, (k, *_) in enumerate(BAD_LAYOUT)]
