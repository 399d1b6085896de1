"""Layout invariance: with the global normaliser, the losses of the micro-batches (over
micro-batches and data-parallel ranks) sum to the full-batch loss, and so do their gradients.

A batch is split by rows into k micro-batches on each of d ranks (d = 1 in one process; d = 2 on
real Gloo groups). Each micro-batch is given ``num_tokens``/``num_seqs`` of the whole batch (or
``group=`` with one micro-batch per rank). Its gradient lands in its own rows of the full
``logp``; the sum over micro-batches and ranks must equal the gradient of the one full-batch
call, and the summed losses its loss. With ``group=`` each call issues exactly one
``all_gather`` (the counts and the metric sums together) and every rank's metrics are the
full batch's.

Budgets: a per-token gradient is the same product in both layouts (same row, same divisor), so
it agrees to rounding of that product: one ulp of the largest gradient (measured: 0 for every
kind but sapo, whose sigmoid rounds differently on different tensor lengths: ≤ 0.06 ulp).
The loss values are sums in different orders; any order of summing ``n`` terms errs by at
most ``(n − 1)·eps·Σ|term|`` (Higham, *Accuracy and Stability*, §4.2), so the two differ by at
most ``(2n + k·d)·eps`` times the same aggregation of ``|ℓ|``.

``clip_cov`` and ``kl_cov`` are left out by definition: they select tokens by statistics of the
call's own batch (as verl, per micro-batch), so a micro-batch selects differently from the full
batch.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed
from tests._losses_util import random_mask

import rlops
from rlops.losses import AGG_MODES, POLICY_KINDS

KINDS = [k for k in POLICY_KINDS if k not in ("clip_cov", "kl_cov")]
B, T = 10, 23


def make_batch(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(B, T, gen)  # row 0 has no action token; interior 0-spans
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    logp = old + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    weights = 0.5 + torch.rand(B, T, generator=gen, dtype=torch.float64)
    return {
        "logp": logp.to(dtype),
        "old": old.to(dtype),
        "adv": adv.to(dtype),
        "weights": weights.to(dtype),
        "mask": mask,
    }


def global_counts(mask):
    """Action tokens and rows with an action token, counted plainly."""
    tokens = sum(int(v) for v in mask.flatten())
    seqs = sum(1 for row in mask if any(int(v) for v in row))
    return tokens, seqs


def call(kind, mode, batch, rows, logp, with_metrics=False, **norm):
    """The policy loss of ``rows`` of ``batch`` (``logp``: the full leaf, sliced)."""
    r = slice(*rows)
    loss, metrics = rlops.policy_loss(
        logp[r],
        batch["old"][r],
        batch["adv"][r],
        batch["mask"][r],
        kind=kind,
        agg=mode,
        rollout_is_weights=batch["weights"][r],
        **norm,
    )
    return (loss, metrics) if with_metrics else loss


def full_batch(kind, mode, batch):
    logp = batch["logp"].clone().requires_grad_(True)
    loss = call(kind, mode, batch, (0, B), logp)
    (grad,) = torch.autograd.grad(loss, logp)
    abs_loss = rlops.aggregate_loss(
        call(kind, None, batch, (0, B), batch["logp"]).abs(), batch["mask"], mode
    )
    return loss.detach(), grad, abs_loss


def assert_same(kind, mode, split_loss, split_grad, batch, pieces):
    loss, grad, abs_loss = full_batch(kind, mode, batch)
    eps = torch.finfo(loss.dtype).eps
    n = int(batch["mask"].sum())
    grad_diff = float((split_grad - grad).abs().max())
    assert grad_diff <= eps * float(grad.abs().max()), (kind, mode, grad_diff)
    loss_diff = float((split_loss - loss).abs())
    assert loss_diff <= (2 * n + pieces) * eps * float(abs_loss), (kind, mode, loss_diff)
    return grad_diff


# --------------------------------------------------------------------------- one process
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_micro_batches_sum_to_the_full_batch(kind, mode, dtype):
    batch = make_batch(dtype)
    tokens, seqs = global_counts(batch["mask"])
    cuts = [0, 1, 4, 5, 8, 10]  # a micro-batch holding only the empty row 0; uneven sizes
    logp = batch["logp"].clone().requires_grad_(True)
    total = sum(
        call(kind, mode, batch, rows, logp, num_tokens=tokens, num_seqs=seqs)
        for rows in itertools.pairwise(cuts)
    )
    total.backward()  # each micro-batch's gradient accumulates into its rows of logp
    assert_same(kind, mode, total.detach(), logp.grad, batch, len(cuts) - 1)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_and_aggregate_loss_micro_batches_sum(mode):
    batch = make_batch(torch.float64, seed=1)
    tokens, seqs = global_counts(batch["mask"])
    m, cuts = batch["mask"], [0, 3, 7, 10]
    v = batch["logp"].clone().requires_grad_(True)
    full_v, _ = rlops.value_loss(v, batch["old"], batch["adv"], m, clip=0.2, agg=mode)
    full_a = rlops.aggregate_loss(v, m, mode)
    (g_full,) = torch.autograd.grad(full_v + full_a, v)
    v2 = batch["logp"].clone().requires_grad_(True)
    total = 0
    for a, b in itertools.pairwise(cuts):
        norm = {"num_tokens": tokens, "num_seqs": torch.tensor(seqs)}  # a count may be a tensor
        lv, _ = rlops.value_loss(
            v2[a:b], batch["old"][a:b], batch["adv"][a:b], m[a:b], clip=0.2, agg=mode, **norm
        )
        total = total + lv + rlops.aggregate_loss(v2[a:b], m[a:b], mode, **norm)
    (g_split,) = torch.autograd.grad(total, v2)
    eps = torch.finfo(torch.float64).eps
    assert (g_split - g_full).abs().max() <= eps * g_full.abs().max()
    torch.testing.assert_close(total, full_v + full_a, rtol=4 * T * B * eps, atol=0)


def test_without_normaliser_each_call_is_its_own_mean():
    batch = make_batch(torch.float64)
    m, x = batch["mask"], batch["adv"]
    part = rlops.aggregate_loss(x[4:], m[4:])
    by_hand = sum(float(x[i, j]) for i in range(4, B) for j in range(T) if m[i, j]) / float(
        m[4:].sum()
    )
    assert abs(float(part) - by_hand) <= 1e-15 * T * B


# --------------------------------------------------------------------------- Gloo, d = 2
SPLITS = {  # per rank: the row ranges of its micro-batches
    "group, one micro-batch per rank": [[(0, 4)], [(4, 10)]],
    "group, rank 0 holds no action token": [[(0, 1)], [(1, 10)]],
    "counts, two micro-batches per rank": [[(0, 2), (2, 5)], [(5, 6), (6, 10)]],
}


def _rank_work(rank, world_size, batch):
    tokens, seqs = global_counts(batch["mask"])
    out = {}
    for split, per_rank in SPLITS.items():
        rows = per_rank[rank]
        for kind in KINDS:
            for mode in AGG_MODES:
                logp = batch["logp"].clone().requires_grad_(True)
                total, metrics = 0, None
                with count_collectives() as calls:
                    if len(rows) == 1:
                        norm = {"group": dist.group.WORLD}
                    else:
                        norm = {"num_tokens": tokens, "num_seqs": seqs}
                    for r in rows:
                        loss, metrics = call(kind, mode, batch, r, logp, True, **norm)
                        total = total + loss
                total.backward()
                out[split, kind, mode] = (total.detach(), logp.grad, dict(calls), metrics)
        if len(rows) == 1:  # value_loss and aggregate_loss under the same group
            (a, b), m = rows[0], batch["mask"]
            for mode in AGG_MODES:
                v = batch["logp"].clone().requires_grad_(True)
                with count_collectives() as calls:
                    vl, vm = rlops.value_loss(
                        v[a:b],
                        batch["old"][a:b],
                        batch["adv"][a:b],
                        m[a:b],
                        clip=0.2,
                        agg=mode,
                        group=dist.group.WORLD,
                    )
                    al = rlops.aggregate_loss(v[a:b], m[a:b], mode, group=dist.group.WORLD)
                (vl + al).backward()
                out[split, "value+aggregate", mode] = (vl + al, v.grad, dict(calls), vm)
    return out


def test_micro_batches_on_two_gloo_ranks_sum_to_the_full_batch():
    batch = make_batch(torch.float64, seed=2)
    ranks = run_distributed(_rank_work, 2, batch, timeout=120)
    worst = {}
    n, m = int(batch["mask"].sum()), batch["mask"]
    for (split, kind, mode), (loss0, grad0, calls, metrics0) in ranks[0].items():
        loss1, grad1, _, metrics1 = ranks[1][split, kind, mode]
        if kind == "value+aggregate":  # one all_gather each (aggregate's token-sum: its check)
            assert calls == {"all_gather": 2}, (mode, calls)
            v = batch["logp"].clone().requires_grad_(True)
            vl, vm = rlops.value_loss(v, batch["old"], batch["adv"], m, clip=0.2, agg=mode)
            full = vl + rlops.aggregate_loss(v, m, mode)
            (g,) = torch.autograd.grad(full, v)
            eps = torch.finfo(torch.float64).eps
            assert (grad0 + grad1 - g).abs().max() <= eps * g.abs().max(), mode
            torch.testing.assert_close(loss0 + loss1, full.detach(), rtol=4 * n * eps, atol=0)
            assert metrics0["vf_clipfrac"] == metrics1["vf_clipfrac"] == vm["vf_clipfrac"]
            continue
        # group=: one all_gather per call (counts, normaliser and metrics); counts given: none
        grouped = split.startswith("group")
        assert calls == ({"all_gather": 1} if grouped else {}), (split, kind, mode, calls)
        if grouped:  # the metrics are the full batch's, on every rank
            _, full = call(kind, mode, batch, (0, B), batch["logp"], True)
            lr = (batch["logp"] - batch["old"]).abs()[batch["mask"].bool()].mean()
            for name, value in full.items():
                scale = float(value.abs()) if name == "seq_ratio_mean" else float(lr)
                budget = 2 * n * torch.finfo(value.dtype).eps * scale  # sums in other orders
                for got in (metrics0[name], metrics1[name]):
                    assert abs(float(got - value)) <= budget, (split, kind, mode, name)
        pieces = sum(len(r) for r in SPLITS[split])
        diff = assert_same(kind, mode, loss0 + loss1, grad0 + grad1, batch, pieces)
        worst[mode] = max(worst.get(mode, 0.0), diff)
    assert set(worst) == set(AGG_MODES)
    print("max |gradient difference| per mode over the kinds, two Gloo ranks:", worst)
