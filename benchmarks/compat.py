"""The compat adapters against the calls they replace, on the callers' own data layouts (CPU).

    python benchmarks/compat.py [--samples 16] [--max-len 8192] [--reps 5] [--threads 1]

One line per call site: median time of the original's algorithm (restated from its public
description in ``rlops.measure.baselines`` or below) and of the adapter, interleaved in one run,
and their ratio. Indicative only: on a shared machine, rerun and compare ratios, not times.
One torch thread by default: on a small shared machine, two OpenMP threads stall every
elementwise op for milliseconds whenever the other core is busy, which hides the algorithms.

* slime ``get_advantages_and_returns_batch``: pad, chunked scan with a Python loop over
  chunks (C = 128), split — vs the adapter.
* slime ``get_reinforce_plus_plus_returns``: the per-sample, per-token loop of the original
  version (the later version pads and reuses the chunk-loop scan above) — vs the adapter.
* verl ``compute_gae_advantage_return``: the masked per-token loop over time, then whitening.
* verl ``compute_grpo_outcome_advantage``: a dict of lists per uid and loops over samples.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from rlops.compat import slime, verl
from rlops.measure.baselines import gae_chunk_loop, group_loop, masked_whiten_moments
from rlops.measure.baselines import returns_token_loop as per_token_returns


def interleaved(fns, reps: int) -> list[float]:
    """Median seconds of each function, runs interleaved (one warm-up each)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def slime_batch_gae(values, rewards, gamma, lam):
    lengths = [v.numel() for v in values]
    v = torch.nn.utils.rnn.pad_sequence(values, batch_first=True)
    r = torch.nn.utils.rnn.pad_sequence(rewards, batch_first=True)
    adv, ret = gae_chunk_loop(r, v, gamma, lam, chunk_size=128)
    return [a[:n] for a, n in zip(adv, lengths)], [g[:n] for g, n in zip(ret, lengths)]


def slime_reinforce(outcome, kl, masks, kl_coef, gamma):
    token_rewards = []
    for o, k, m in zip(outcome, kl, masks):
        r = -kl_coef * k * m
        r[int(m.nonzero()[-1])] += o
        token_rewards.append(r)
    return per_token_returns(token_rewards, gamma)


def verl_gae(r, v, m, gamma, lam):
    nxt = torch.zeros(r.shape[0])
    last = torch.zeros(r.shape[0])
    out = []
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * nxt - v[:, t]
        new = delta + gamma * lam * last
        nxt = v[:, t] * m[:, t] + (1 - m[:, t]) * nxt
        last = new * m[:, t] + (1 - m[:, t]) * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return masked_whiten_moments(adv, m), adv + v


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(a.max_len // 4, a.max_len + 1, (a.samples,), generator=gen).tolist()
    values = [torch.randn(n, generator=gen) for n in lengths]
    rewards = [torch.randn(n, generator=gen) * 0.01 for n in lengths]
    masks = [(torch.rand(n, generator=gen) > 0.2).float() for n in lengths]
    for m in masks:
        m[0] = 1
    outcome = torch.randn(a.samples, generator=gen)
    totals = [n + 100 for n in lengths]
    short = [x[: a.max_len // 4] for x in rewards]  # the token loop is slow: shorter responses
    short_masks = [m[: a.max_len // 4] for m in masks]
    short_len = [x.numel() for x in short]

    b, t = 8, a.max_len
    r2 = torch.randn(b, t, generator=gen) * 0.01
    v2 = torch.randn(b, t, generator=gen)
    m2 = (torch.rand(b, t, generator=gen) > 0.2).float()
    scores = torch.randint(0, 2, (256, 1), generator=gen).float().expand(256, 1024).contiguous()
    m3 = torch.ones(256, 1024)
    uids = np.array([f"prompt-{i // 8}" for i in range(256)], dtype=object)

    cases = {
        f"slime get_advantages_and_returns_batch ({a.samples} samples, T <= {a.max_len})": (
            lambda: slime_batch_gae(values, rewards, 1.0, 0.95),
            lambda: slime.get_advantages_and_returns_batch(totals, lengths, values, rewards,
                                                           1.0, 0.95),
        ),
        f"slime get_reinforce_plus_plus_returns ({a.samples} samples, T <= {a.max_len // 4})": (
            lambda: slime_reinforce(outcome, short, short_masks, 0.01, 1.0),
            lambda: slime.get_reinforce_plus_plus_returns(outcome, short, short_masks, short_len,
                                                          short_len, 0.01, 1.0),
        ),
        f"verl compute_gae_advantage_return ({b}x{t}, tool tokens)": (
            lambda: verl_gae(r2, v2, m2, 1.0, 0.95),
            lambda: verl.compute_gae_advantage_return(r2, v2, m2, 1.0, 0.95),
        ),
        "verl compute_grpo_outcome_advantage (256x1024, groups of 8)": (
            lambda: group_loop(scores.sum(-1), list(uids), m3, "grpo"),
            lambda: verl.compute_grpo_outcome_advantage(scores, m3, uids),
        ),
    }
    print(f"torch threads={torch.get_num_threads()}, median of {a.reps} interleaved runs")
    print(f"{'call site':<68} {'original ms':>12} {'adapter ms':>11} {'ratio':>8}")
    for name, (theirs, ours) in cases.items():
        t_theirs, t_ours = interleaved([theirs, ours], a.reps)
        print(f"{name:<68} {1e3 * t_theirs:12.2f} {1e3 * t_ours:11.2f} "
              f"{t_theirs / t_ours:7.1f}x")


if __name__ == "__main__":
    main()
