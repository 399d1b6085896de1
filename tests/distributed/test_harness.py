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


def _state(rank: int, world_size: int, set_env: bool) -> tuple:
    import os

    seen = os.environ.get("RLOPS_HARNESS_PROBE")
    if set_env:
        os.environ["RLOPS_HARNESS_PROBE"] = "set"
        torch.set_num_threads(2)
    return os.getpid(), seen, torch.get_num_threads()


def _extra_collective(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(5))  # rank 1 never makes it


def test_a_warm_group_runs_each_call_as_a_fresh_process_would():
    first = run_distributed(_state, 2, True)
    second = run_distributed(_state, 2, False)
    for a, b in zip(first, second, strict=True):
        assert a[0] == b[0]  # the same processes
        assert b[1] is None  # the variable the first call set is gone
        assert b[2] == 1
    assert first[0][0] != first[1][0]


def test_a_call_that_leaves_the_ranks_out_of_step_fails_and_the_next_starts_anew():
    before = run_distributed(_state, 2, False)
    with pytest.raises((RankError, TimeoutError)):
        run_distributed(_extra_collective, 2, timeout=10)
    after = run_distributed(_state, 2, False)
    assert {p for p, *_ in before}.isdisjoint(p for p, *_ in after)


def test_fresh_runs_in_processes_of_its_own():
    warm = run_distributed(_state, 2, False)
    fresh = run_distributed(_state, 2, False, fresh=True)
    assert {p for p, *_ in warm}.isdisjoint(p for p, *_ in fresh)
