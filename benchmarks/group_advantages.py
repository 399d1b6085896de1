"""Group estimators: rlops vs the per-sample Python loop that verl ships (B=256, T=8192, CPU).

    python benchmarks/group_advantages.py [--batch 256] [--seq-len 8192] [--group 8]

Prints one line per estimator: median and minimum time of each side (interleaved runs) and their
ratios, measured in this run, for a float mask (whose 0/1 values rlops checks) and a bool mask.
The loops below follow verl's ``compute_*_outcome_advantage`` (a dict of lists per group id,
a Python loop over samples); ReMax has no loop in verl, so it is timed against verl's
vectorised flip-cumsum form instead.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import rlops.group_advantages as ga
from rlops.measure.baselines import group_loop as loop_group
from rlops.measure.baselines import remax_flip_cumsum as verl_remax


def time_pair(ours, theirs, reps=21):
    """Interleaved timings (ms) of both sides: (median, min) each. On a shared machine the
    minimum is the least disturbed run; both are printed."""
    ours(), theirs()
    t = {ours: [], theirs: []}
    for _ in range(reps):
        for fn in (ours, theirs):
            t0 = time.perf_counter()
            fn()
            t[fn].append(1e3 * (time.perf_counter() - t0))
    return [(statistics.median(t[f]), min(t[f])) for f in (ours, theirs)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--group", type=int, default=8)
    a = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    b, t = a.batch, a.seq_len
    scores = torch.randint(0, 2, (b,), generator=gen).float()
    index = torch.randperm(b, generator=gen) // a.group * 7919  # arbitrary, non-contiguous ids
    lengths = torch.randint(1, t + 1, (b, 1), generator=gen)
    bool_mask = torch.arange(t) < lengths
    rewards = torch.zeros(b, t).scatter_(1, lengths - 1, scores[:, None])
    ids = index.tolist()  # verl passes a numpy array of uids; conversion not timed
    print(f"B={b} T={t} group={a.group} float32, {torch.get_num_threads()} threads")
    for mask in (bool_mask.float(), bool_mask):
        checked = "its 0/1 values are checked" if mask.dtype != torch.bool else "no value check"
        print(f"mask {mask.dtype} ({checked})")
        run(scores, index, ids, rewards, mask)


def run(scores, index, ids, rewards, mask) -> None:
    fmask = mask.float()
    cases = [
        (
            "grpo",
            lambda: ga.grpo_advantages(scores, index, mask),
            lambda: loop_group(scores, ids, fmask, "grpo"),
        ),
        (
            "rloo",
            lambda: ga.rloo_advantages(scores, index, mask),
            lambda: loop_group(scores, ids, fmask, "rloo"),
        ),
        (
            "reinforce++-baseline",
            lambda: ga.reinforce_plus_plus_baseline_advantages(scores, index, mask),
            lambda: loop_group(scores, ids, fmask, "rfpp"),
        ),
        (
            "remax (vs verl vectorised)",
            lambda: ga.remax_advantages(rewards, scores, mask),
            lambda: verl_remax(rewards, scores, fmask),
        ),
    ]
    for name, ours, theirs in cases:
        torch.testing.assert_close(ours()[0], theirs()[0], rtol=1e-5, atol=1e-5)
        (med_o, min_o), (med_t, min_t) = time_pair(ours, theirs)
        print(
            f"{name:28s} rlops {med_o:7.2f} ms (min {min_o:6.2f})   baseline {med_t:7.2f} ms "
            f"(min {min_t:6.2f})   x{med_t / med_o:5.1f} (min x{min_t / min_o:5.1f})"
        )


if __name__ == "__main__":
    main()
