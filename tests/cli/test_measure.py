"""Peak memory seen by a fresh process does not depend on the size of the process that
started it; the process times its step at each thread count asked for, and one process times
several steps interleaved."""

from __future__ import annotations

import torch

from rlops.measure.timing import (
    measure_in_fresh_process,
    peak_in_fresh_process,
    time_in_fresh_process,
)
from rlops.measure.workloads import setup_logits


def test_fresh_process_peak_ignores_a_large_parent():
    """Unfused log-probs + entropy over [256, 4096] float32 logits (4 MiB each) materialise
    several [256, 4096] temporaries; the parent holds 256 MiB meanwhile. ``ru_maxrss`` would
    start the child at the parent's size and see no growth."""
    ballast = torch.ones(64 * 2**20)  # 256 MiB, resident
    m = measure_in_fresh_process(
        setup_logits,
        {"t": 256, "v": 4096, "fused": False},
        prime_kwargs={"t": 8, "v": 64, "fused": False},
        threads=(2, 1),
        repeats=1,
    )
    assert ballast[-1] == 1
    assert m["peak_extra_bytes"] >= 3 * 256 * 4096 * 4
    assert set(m["time_s_by_threads"]) == {1, 2}  # timed at each count given
    assert m["time_s"] == m["time_s_by_threads"][2]  # the first count's


def test_peak_alone_and_times_interleaved_in_fresh_processes():
    """What ``rlops bench`` measures a log-prob case with: each variant's peak in a process of
    its own (no timing), then both variants' times in one process, at each count."""
    tiny = {"t": 8, "v": 64}
    peak = peak_in_fresh_process(
        setup_logits, {"t": 256, "v": 4096, "fused": False},
        prime_kwargs={**tiny, "fused": False}, threads=2,
    )  # fmt: skip
    assert peak >= 3 * 256 * 4096 * 4
    setups = {
        f"fused={f}": (setup_logits, {"t": 16, "v": 128, "fused": f}, {**tiny, "fused": f})
        for f in (False, True)
    }
    times = time_in_fresh_process(setups, (1, 2), repeats=2)
    assert list(times) == ["fused=False", "fused=True"]
    assert all(set(t) == {1, 2} and min(t.values()) > 0 for t in times.values())
