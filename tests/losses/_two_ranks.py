"""One loss on two Gloo ranks, with ``group=`` (each rank half the rows) and with ``cp_group=``
(each rank half of every row), against the one-process call on the whole batch."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tests._distributed import run_distributed

from rlops.distributed import cp_shard

__all__ = ["assert_group_and_cp_equal_the_whole_batch"]

AGG = {"group": "token-mean", "cp": "seq-mean-token-mean"}


def _rank_work(rank, world_size, fn, data, layout):
    """(loss, gradient of the first input, metrics) of ``fn`` on this rank's part, each way."""
    out = {}
    half = data[0].shape[0] // 2
    rows = slice(0, half) if rank == 0 else slice(half, None)
    x = data[0].clone().requires_grad_(True)
    loss, m = fn(x[rows], *(t[rows] for t in data[1:]), agg=AGG["group"], group=dist.group.WORLD)
    (g,) = torch.autograd.grad(loss, x)
    out["group"] = (loss.detach(), g, m)
    shard = [cp_shard(t, cp_size=2, cp_rank=rank, layout=layout) for t in data]
    x = shard[0].clone().requires_grad_(True)
    loss, m = fn(x, *shard[1:], agg=AGG["cp"], cp_group=dist.group.WORLD, cp_layout=layout)
    (g,) = torch.autograd.grad(loss, x)
    out["cp"] = (loss.detach(), g, m)
    return out


def assert_group_and_cp_equal_the_whole_batch(fn, data, metrics, layout="zigzag"):
    """``fn(first, *rest, agg=..., **group_kw) -> (loss, metrics)``, a module-level function;
    the gradient is taken in ``data[0]``. The ranks' shares sum to the one-process loss, each
    rank's gradient is its part of the one-process gradient, every rank's ``metrics`` are the
    whole batch's."""
    ranks = run_distributed(_rank_work, 2, fn, data, layout, timeout=120)
    for way, agg in AGG.items():
        x = data[0].clone().requires_grad_(True)
        loss, m = fn(x, *data[1:], agg=agg)
        (g,) = torch.autograd.grad(loss, x)
        torch.testing.assert_close(ranks[0][way][0] + ranks[1][way][0], loss.detach())
        if way == "group":
            torch.testing.assert_close(ranks[0][way][1] + ranks[1][way][1], g)
        for r in (0, 1):
            if way == "cp":
                want = cp_shard(g, cp_size=2, cp_rank=r, layout=layout)
                torch.testing.assert_close(ranks[r][way][1], want)
            for key in metrics:
                torch.testing.assert_close(ranks[r][way][2][key], m[key])
