"""The multi-process test harness reports errors and hangs instead of blocking.

(Results in rank order and collective counts are exercised by the suites that use it.)
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from tests._distributed import RankError, count_collectives, run_distributed

pytestmark = pytest.mark.distributed


def _fail(rank: int, world_size: int, x: torch.Tensor) -> None:
    with count_collectives() as calls:
        dist.all_reduce(x)
        names = [None] * world_size
        dist.all_gather_object(names, f"rank{rank}")
    # A collective implemented through another one counts once, under the name called.
    assert dict(calls) == {"all_reduce": 1, "all_gather_object": 1}, calls
    assert names == [f"rank{r}" for r in range(world_size)]
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    dist.barrier()  # blocks: rank 1 never joins


def _hang(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)


def test_rank_error_is_raised_and_others_stopped():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank one fails on purpose"):
        run_distributed(_fail, 2, torch.ones(3), timeout=120)
    assert time.monotonic() - start < 60


def test_hang_times_out():
    with pytest.raises(TimeoutError, match="did not finish"):
        run_distributed(_hang, 2, timeout=4)
