"""The multi-process test harness reports results, errors and hangs instead of blocking."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from tests._distributed import RankError, count_collectives, run_distributed

pytestmark = pytest.mark.distributed


def _sum_and_fail(rank: int, world_size: int, x: torch.Tensor, fail: bool) -> dict:
    with count_collectives() as calls:
        y = x + rank
        dist.all_reduce(y)
        names = [None] * world_size
        dist.all_gather_object(names, f"rank{rank}")
    if fail and rank == 1:
        raise ValueError("rank one fails on purpose")
    if fail:
        dist.barrier()  # blocks forever: rank 1 never joins
    return {"y": y, "calls": dict(calls), "names": names}


def _hang(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)


def test_results_in_rank_order_and_counts():
    res = run_distributed(_sum_and_fail, 2, torch.ones(3), False)
    for r in res:
        torch.testing.assert_close(r["y"], torch.full((3,), 3.0))
        assert r["calls"] == {"all_reduce": 1, "all_gather_object": 1}
        assert r["names"] == ["rank0", "rank1"]


def test_rank_error_is_raised_and_others_stopped():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank one fails on purpose"):
        run_distributed(_sum_and_fail, 2, torch.ones(3), True, timeout=120)
    assert time.monotonic() - start < 60


def test_hang_times_out():
    with pytest.raises(TimeoutError, match="did not finish"):
        run_distributed(_hang, 2, timeout=4)
