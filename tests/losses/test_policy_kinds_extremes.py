"""Extreme inputs to every policy-loss kind (log-ratios ±50, certain tokens, all-masked and
one-action rows, a 32K-token row), all-masked batches and meta tensors (no host read), over
both registries of ``tests/losses/_references.py``; bad options are in test_options.py."""

from __future__ import annotations

import math

import pytest
import torch
from tests._losses_util import acc_dtype, make_inputs
from tests.losses._references import (
    CASES,
    F64,
    KINDS,
    OPTIONS,
    kind_and_options,
    run_any,
)

import rlops
from rlops.losses import AGG_MODES

ALL = (*KINDS, *CASES)  # every entry of both registries


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, F64])
@pytest.mark.parametrize("name", ALL)
def test_extreme_inputs_are_finite(name, dtype):
    """log-ratios ±50, log π = 0 (a certain token: DPPO-KL's 1 − π = 0), an all-masked row,
    one-action rows, a 32K-token row of log-ratio 0.01."""
    old = torch.tensor(
        [
            [0.0, -50.0, -5.0, 0.0],
            [-50.0, 0.0, -3.0, -3.0],
            [-1, -1, -1, -1],
            [-2.0, -2.0, -2.0, -2.0],
        ],
        dtype=dtype,
    )
    logp = torch.tensor(
        [
            [-50.0, 0.0, -5.0, 0.0],
            [0.0, -50.0, -3.0, -3.0],
            [-1, -1, -1, -1],
            [-1.5, -2.0, -2.0, -2.0],
        ],
        dtype=dtype,
    )
    adv = torch.tensor(
        [[1.0, -1.0, 2.0, 2.0], [-3.0, 3.0, 2.0, 2.0], [1, 1, 1, 1], [-1.0, 0.0, 0.0, 0.0]],
        dtype=dtype,
    )
    for mask in (
        torch.ones(4, 4),
        torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]),
    ):
        for mode in AGG_MODES:
            lp = logp.clone().requires_grad_(True)
            loss, metrics = run_any(name, lp, old, adv, mask, agg=mode)
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), (mode, mask)
            assert all(torch.isfinite(v) for v in metrics.values())
            assert (lp.grad[mask == 0] == 0).all()
    t = 32768
    lp = torch.full((1, t), -1.0, dtype=dtype)
    old = lp - 0.01
    mat, _ = run_any(name, lp, old, torch.ones(1, t, dtype=dtype), torch.ones(1, t), agg=None)
    assert torch.isfinite(mat).all()
    if name in ("gspo", "geo_mean"):  # the row's ratio is e^0.01 (a product would be e^327)
        d = float(lp[0, 0].double() - old[0, 0].double())  # 0.01 as rounded in dtype
        want = -math.exp(d)
        if name == "gspo":
            want = -min(math.exp(d), 1 + OPTIONS["gspo"]["clip_high"])
        eps = torch.finfo(acc_dtype(dtype)).eps
        assert abs(float(mat[0, 0]) - want) <= 64 * eps, float(mat[0, 0])


@pytest.mark.parametrize("name", ALL)
def test_all_masked_batch_gives_zero_loss_and_gradient(name):
    logp, old, adv, _ = make_inputs(F64, 17, b=3, t=5)
    for mode in AGG_MODES:
        lp = logp.clone().requires_grad_(True)
        loss, metrics = run_any(name, lp, old, adv, torch.zeros(3, 5), agg=mode)
        (g,) = torch.autograd.grad(loss, lp)
        assert loss == 0 and (g == 0).all(), (name, mode)
        assert all(v == 0 or k == "seq_ratio_mean" for k, v in metrics.items())


@pytest.mark.parametrize("name", ALL)
def test_meta_tensors_need_no_host_read(name):
    """On meta tensors any host read raises: every kind, with weights, forward and backward."""
    kind, opts = kind_and_options(name)

    def t(*shape, grad=False, dtype=torch.float32):
        return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)

    for dtype in (torch.float32, torch.bfloat16):
        lp = t(3, 7, grad=True, dtype=dtype)
        mask = torch.empty(3, 7, device="meta", dtype=torch.bool)
        loss, metrics = rlops.policy_loss(
            lp, t(3, 7, dtype=dtype), t(3, 7), mask, kind=kind, rollout_is_weights=t(3, 7), **opts
        )
        loss.backward()
        count = torch.empty((), device="meta")
        for mode in AGG_MODES:  # global counts as device tensors are not read either
            rlops.policy_loss(
                lp,
                t(3, 7, dtype=dtype),
                t(3, 7),
                mask,
                kind=kind,
                agg=mode,
                num_tokens=count,
                num_seqs=count,
                **opts,
            )[0].backward()
        cpu, cpu_metrics = rlops.policy_loss(
            torch.zeros(3, 7, dtype=dtype),
            torch.zeros(3, 7),
            torch.zeros(3, 7),
            torch.ones(3, 7),
            kind=kind,
            **opts,
        )
        assert loss.shape == cpu.shape and loss.dtype == cpu.dtype
        assert sorted(metrics) == sorted(cpu_metrics)
        assert lp.grad.shape == lp.shape
    # the sequence means without global counts: the rows' counts on the meta device too
    x = t(3, 7, grad=True)
    run_any(name, x, t(3, 7), t(3, 7), mask, agg="seq-mean-token-mean")[0].backward()
