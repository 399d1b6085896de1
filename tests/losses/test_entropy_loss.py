"""entropy_loss: hand-computed values and gradients per aggregation mode, a per-row loop,
layout invariance with global normalisers, the gradient through the fused entropy, bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed
from tests._losses_util import random_mask

import rlops
from rlops.losses import AGG_MODES, entropy_loss

NAN, INF = float("nan"), float("inf")


def hand_case():
    """Row 0: four tokens summing to 5; row 1: tokens 3 and 7 (NaN, inf padding between);
    row 2: no action token. N = 6 tokens, S = 2 rows, T = 4."""
    h = torch.tensor(
        [[0.5, 1.0, 1.5, 2.0], [3.0, NAN, INF, 7.0], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64
    )
    m = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 1], [0, 0, 0, 0]])
    return h, m


# mode: (aggregated entropy, its gradient for row 0's tokens, for row 1's action tokens)
HAND = {
    "token-mean": (15 / 6, 1 / 6, 1 / 6),
    "token-sum": (15.0, 1.0, 1.0),
    "seq-mean-token-sum": ((5 + 10) / 2, 1 / 2, 1 / 2),
    "seq-mean-token-mean": ((5 / 4 + 10 / 2) / 2, 1 / 8, 1 / 4),
    "seq-mean-token-sum-norm": ((5 + 10) / 2 / 4, 1 / 8, 1 / 8),
}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_hand_computed_value_and_gradient(mode):
    h, m = hand_case()
    h = h.requires_grad_(True)
    loss, metrics = entropy_loss(h, m, agg=mode, coef=0.01)
    value, w0, w1 = HAND[mode]
    assert metrics["entropy"].item() == pytest.approx(value, rel=1e-15)
    assert loss.item() == pytest.approx(-0.01 * value, rel=1e-15)
    assert metrics["entropy"].grad_fn is None and loss.dtype == torch.float64
    (g,) = torch.autograd.grad(loss, h)
    want = torch.zeros_like(g)
    want[0] = -0.01 * w0
    want[1, [0, 3]] = -0.01 * w1
    torch.testing.assert_close(g, want, rtol=1e-15, atol=0)  # 0 on padding despite NaN/inf


def test_loss_scale_factor_for_the_norm_mode():
    h, m = hand_case()
    loss, metrics = entropy_loss(h, m, agg="seq-mean-token-sum-norm", loss_scale_factor=3)
    assert metrics["entropy"].item() == pytest.approx(7.5 / 3, rel=1e-15)
    assert loss.item() == pytest.approx(-7.5 / 3, rel=1e-15)


def loop_aggregate(h, m, mode):
    """The modes written out row by row (plain Python floats)."""
    rows, total, count = [], 0.0, 0
    for i in range(h.shape[0]):
        vals = [float(h[i, j]) for j in range(h.shape[1]) if m[i, j]]
        total, count = total + sum(vals), count + len(vals)
        if vals:
            rows.append(sum(vals) / len(vals) if mode == "seq-mean-token-mean" else sum(vals))
    if mode == "token-mean":
        return total / count
    if mode == "token-sum":
        return total
    out = sum(rows) / len(rows)
    return out / h.shape[1] if mode == "seq-mean-token-sum-norm" else out


@pytest.mark.parametrize("mode", AGG_MODES)
def test_random_batch_matches_a_loop(mode):
    gen = torch.Generator().manual_seed(0)
    h = torch.rand(7, 33, generator=gen, dtype=torch.float64) * 5
    m = random_mask(7, 33, gen)
    loss, metrics = entropy_loss(h, m, agg=mode, coef=-0.3)
    want = loop_aggregate(h, m, mode)
    assert metrics["entropy"].item() == pytest.approx(want, rel=1e-13)
    assert loss.item() == pytest.approx(0.3 * want, rel=1e-13)


def test_gradcheck_entropy_and_tensor_coef():
    gen = torch.Generator().manual_seed(1)
    h = torch.rand(3, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
    coef = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    m = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    for mode in AGG_MODES:
        assert torch.autograd.gradcheck(
            lambda a, c, mode=mode: entropy_loss(a, m, agg=mode, coef=c)[0], (h, coef)
        )


def test_gradient_reaches_the_logits_through_the_fused_entropy():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 11, generator=gen, dtype=torch.float64)
    target = torch.randint(0, 11, (2, 5), generator=gen)
    m = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    lg = logits.clone().requires_grad_(True)
    _, ent = rlops.logprobs_and_entropy(lg, target)
    (g,) = torch.autograd.grad(entropy_loss(ent, m, coef=0.1)[0], lg)
    # The plain softmax entropy −Σ p log p, token by token.
    lg2 = logits.clone().requires_grad_(True)
    p = torch.softmax(lg2, -1)
    plain = -(p * torch.log_softmax(lg2, -1)).sum(-1)
    total = sum(plain[i, j] for i in range(2) for j in range(5) if m[i, j])
    (g_plain,) = torch.autograd.grad(-0.1 * total / 8, lg2)
    torch.testing.assert_close(g, g_plain, rtol=1e-10, atol=1e-13)
    assert g[0, 3:].abs().max() == 0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_with_global_counts_sum_to_the_full_batch(mode):
    gen = torch.Generator().manual_seed(3)
    h = (torch.rand(9, 17, generator=gen, dtype=torch.float64) * 4).requires_grad_(True)
    m = random_mask(9, 17, gen)
    full, full_metrics = entropy_loss(h, m, agg=mode, coef=0.05)
    (g_full,) = torch.autograd.grad(full, h)
    n_tokens = m.sum()  # 0-dim tensors: used on the device as they are
    n_seqs = (m.sum(-1) > 0).sum()
    parts, metric, grads = 0, 0, []
    for a, b in ((0, 2), (2, 3), (3, 9)):
        hp = h.detach()[a:b].clone().requires_grad_(True)
        loss, metrics = entropy_loss(
            hp, m[a:b], agg=mode, coef=0.05, num_tokens=n_tokens, num_seqs=n_seqs
        )
        parts, metric = parts + loss, metric + metrics["entropy"]
        grads.append(torch.autograd.grad(loss, hp)[0])
    torch.testing.assert_close(parts, full, rtol=1e-14, atol=0)
    torch.testing.assert_close(metric, full_metrics["entropy"], rtol=1e-14, atol=0)
    torch.testing.assert_close(torch.cat(grads), g_full, rtol=1e-14, atol=0)


def _rank_work(rank, world_size, h, m):
    rows = slice(rank * 3, rank * 3 + 3)
    out = {}
    for mode in AGG_MODES:
        with count_collectives() as calls:
            loss, metrics = entropy_loss(
                h[rows], m[rows], agg=mode, coef=0.2, group=dist.group.WORLD
            )
        out[mode] = (loss, metrics["entropy"], sum(calls.values()))
    return out


@pytest.mark.distributed
def test_group_shares_sum_to_the_full_batch():
    gen = torch.Generator().manual_seed(4)
    h = torch.rand(6, 13, generator=gen, dtype=torch.float64)
    m = random_mask(6, 13, gen)
    ranks = run_distributed(_rank_work, 2, h, m, timeout=120)
    for mode in AGG_MODES:
        full, metrics = entropy_loss(h, m, agg=mode, coef=0.2)
        torch.testing.assert_close(sum(r[mode][0] for r in ranks), full, rtol=1e-14, atol=0)
        torch.testing.assert_close(
            sum(r[mode][1] for r in ranks), metrics["entropy"], rtol=1e-14, atol=0
        )
        # one collective (token-sum needs no count, but its call is checked all the same)
        assert all(r[mode][2] == 1 for r in ranks)


def test_half_inputs_coef_forms_and_sign():
    h, m = hand_case()
    h = h.nan_to_num(0.0, posinf=0.0)
    bf = h.to(torch.bfloat16)
    loss, metrics = entropy_loss(bf, m)
    assert loss.dtype == torch.float32 and metrics["entropy"].dtype == torch.float32
    assert loss.item() == -2.5  # the entries are exact in bfloat16
    for coef in (0.25, torch.tensor(0.25), torch.tensor(0.25, dtype=torch.float64)):
        loss, _ = entropy_loss(h.float(), m, coef=coef)
        assert loss.dtype == torch.float32 and loss.item() == -0.625
    assert entropy_loss(h, m, coef=-2.0)[0].item() == 5.0  # a negative coef penalises entropy
    zero, _ = entropy_loss(h.requires_grad_(True), m, coef=0)
    assert zero.item() == 0 and torch.autograd.grad(zero, h)[0].abs().max() == 0


def test_bad_input_errors_name_the_argument():
    h, m = hand_case()
    with pytest.raises(TypeError, match="entropy"):
        entropy_loss(h.long(), m)
    with pytest.raises(ValueError, match="entropy"):
        entropy_loss(h[0], m[0])
    with pytest.raises(ValueError, match="mask"):
        entropy_loss(h, m[:, :2])
    with pytest.raises(ValueError, match="mask"):
        entropy_loss(h, m * 2)
    for agg in ("mean", None, "token_mean"):
        with pytest.raises(ValueError, match="agg"):
            entropy_loss(h, m, agg=agg)
    for coef in (math.nan, math.inf):
        with pytest.raises(ValueError, match="coef"):
            entropy_loss(h, m, coef=coef)
    with pytest.raises(TypeError, match="coef"):
        entropy_loss(h, m, coef="0.01")
    with pytest.raises(TypeError, match="coef"):
        entropy_loss(h, m, coef=torch.tensor(1))
    with pytest.raises(ValueError, match="coef"):
        entropy_loss(h, m, coef=torch.ones(2))
    with pytest.raises(ValueError, match="num_tokens"):
        entropy_loss(h, m, num_tokens=-1)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        entropy_loss(h, m, agg="seq-mean-token-sum-norm", loss_scale_factor=0)
