"""Context-parallel GAE: bytes exchanged and wall time, on real Gloo ranks of this machine.

    python benchmarks/context_parallel.py [--seq-len 131072] [--cp 4] [--batch 1]

Three ways to get each rank's shard of GAE over a zigzag-sharded sequence:

* ``rlops cp``: ``rlops.gae(..., cp_group=g)``: local scans, one ``all_gather`` of per-chunk
  carries (five numbers per chunk and row; ``RLOPS_CP_CHECK=0`` so the optional metadata
  exchange is off), fix-up;
* ``gather full``: ``all_gather`` the shards of rewards and values, run GAE on the whole
  sequence on every rank, keep the own shard (what trainers do today);
* ``single process``: GAE on the unsharded batch, no communication (for reference).

Bytes are counted on every ``all_gather`` call (what one rank sends; it receives cp times
that). Times are medians over repeats, taken on each rank and reported for rank 0. Gloo on one
machine with 2 cores is indicative only: cp processes share the cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests._distributed import run_distributed

import rlops
from rlops.distributed import zigzag_shard, zigzag_unshard


def _data(batch: int, t_len: int):
    g = torch.Generator().manual_seed(0)
    r = torch.randn(batch, t_len, generator=g)
    v = torch.randn(batch, t_len, generator=g)
    mask = torch.rand(batch, t_len, generator=g) > 0.2
    return r, v, mask


def _rank(rank: int, world: int, batch: int, t_len: int, repeats: int):
    os.environ["RLOPS_CP_CHECK"] = "0"
    r, v, mask = _data(batch, t_len)
    shard = lambda x: zigzag_shard(x, cp_size=world, cp_rank=rank)  # noqa: E731
    rs, vs, ms = shard(r), shard(v), shard(mask)
    group = dist.group.WORLD
    sent = []
    original = dist.all_gather

    def counting(parts, tensor, *a, **k):
        sent.append(tensor.numel() * tensor.element_size())
        return original(parts, tensor, *a, **k)

    def ours():
        return rlops.gae(rs, vs, gamma=1.0, lam=0.95, mask=ms, cp_group=group)

    def gather_full():
        full_r = zigzag_unshard(rs, group=group, length=t_len)
        full_v = zigzag_unshard(vs, group=group, length=t_len)
        full_m = zigzag_unshard(ms.to(torch.uint8), group=group, length=t_len).bool()
        adv, ret = rlops.gae(full_r, full_v, gamma=1.0, lam=0.95, mask=full_m)
        return shard(adv), shard(ret)

    out = {}
    for name, fn in (("rlops cp", ours), ("gather full", gather_full)):
        fn()
        dist.all_gather = counting
        sent.clear()
        fn()
        dist.all_gather = original
        times = []
        for _ in range(repeats):
            dist.barrier(group)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = {
            "seconds": statistics.median(times),
            "bytes_sent": sum(sent),
            "collectives": len(sent),
        }
    a, b = ours(), gather_full()
    out["max_abs_diff"] = max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args(argv)
    res = run_distributed(_rank, a.cp, a.batch, a.seq_len, a.repeats, timeout=600)[0]
    r, v, mask = _data(a.batch, a.seq_len)
    rlops.gae(r, v, gamma=1.0, lam=0.95, mask=mask)
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        rlops.gae(r, v, gamma=1.0, lam=0.95, mask=mask)
        times.append(time.perf_counter() - t0)
    single = statistics.median(times)
    print(f"GAE with a mask, B={a.batch}, T={a.seq_len}, cp={a.cp}, float32, Gloo on one machine")
    print(
        f"{'method':<16}{'collectives':>12}{'bytes sent/rank':>18}{'bytes recv/rank':>18}"
        f"{'median ms':>12}"
    )
    for name in ("rlops cp", "gather full"):
        m = res[name]
        print(
            f"{name:<16}{m['collectives']:>12}{m['bytes_sent']:>18,}"
            f"{m['bytes_sent'] * a.cp:>18,}{m['seconds'] * 1e3:>12.3f}"
        )
    print(f"{'single process':<16}{0:>12}{0:>18}{0:>18}{single * 1e3:>12.3f}")
    ratio = res["gather full"]["bytes_sent"] / res["rlops cp"]["bytes_sent"]
    speed = res["gather full"]["seconds"] / res["rlops cp"]["seconds"]
    print(
        f"bytes: gather full / rlops cp = {ratio:,.0f}x; "
        f"time: rlops cp / single process = {res['rlops cp']['seconds'] / single:.2f}x, "
        f"gather full / rlops cp = {speed:.2f}x; "
        f"max |cp - gather| = {res['max_abs_diff']:.2e}"
    )


if __name__ == "__main__":
    main()
