"""Masked statistics over a process group (DP x CP = 2 x 2, four Gloo ranks) equal the
statistics of the concatenated batch on one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed

import rlops

pytestmark = pytest.mark.distributed


def _shards(seed: int):
    """Four ranks' (x, mask); rank 3 holds only masked tokens."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, 5 + r, generator=g, dtype=torch.float64) * 3 + 7 for r in range(4)]
    masks = [torch.rand(2, 5 + r, generator=g) > 0.3 for r in range(4)]
    masks[3] = torch.zeros_like(masks[3])
    return xs, masks


def _whiten(rank: int, world: int):
    group = dist.group.WORLD
    xs, masks = _shards(0)
    x = xs[rank]
    with count_collectives() as calls:
        w = rlops.masked_whiten(x, masks[rank], group=group)
    mean = rlops.masked_mean(x, masks[rank], group=group)
    var = rlops.masked_var(x, masks[rank], group=group)
    const = rlops.masked_whiten(torch.full((2, 4), 3.0), torch.ones(2, 4), group=group)
    return w, mean, var, dict(calls), const


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_whitening_over_dp_x_cp_equals_whole_batch(world):
    results = run_distributed(_whiten, world)
    xs, masks = (s[:world] for s in _shards(0))
    flat_x = torch.cat([x.reshape(-1) for x in xs])
    flat_m = torch.cat([m.reshape(-1) for m in masks])
    want = rlops.masked_whiten(flat_x, flat_m)
    sel = flat_x[flat_m]
    offset = 0
    for rank, (w, mean, var, calls, const) in enumerate(results):
        n = xs[rank].numel()
        torch.testing.assert_close(w.reshape(-1), want[offset : offset + n])
        offset += n
        torch.testing.assert_close(mean, sel.mean())
        torch.testing.assert_close(var, sel.var())
        assert calls == {"all_gather": 1}
        assert torch.isfinite(const).all() and (const == 0).all()
    if world == 4:
        assert (results[3][0] == 0).all()  # the rank with only masked tokens
