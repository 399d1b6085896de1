"""The chunked scan beside a busy process: its time at torch's default thread count over its
time at one thread.

    python benchmarks/threads.py [--shapes 8x2048 8x32768] [--rounds 15] [--no-busy]

A loop of small torch operations, each split over the intra-op threads and joined after it,
waits at every join for a thread that shares its core with another process. The chunked rows
run on one single-threaded worker instead (``rlops.scan._dispatch``); this measures what is
left: for each shape, ``rlops.gae`` and ``rlops.discounted_cumsum`` with ``method="chunked"``
timed at 1 thread and at the default count, alternating in rounds (each a median of calls)
while a child process spins on one core, and the median over rounds of the ratio
default / 1 thread. The goal: at most 1.5. glibc's malloc keeps freed memory, as in
``rlops bench`` (``rlops.measure.timing.keep_freed_memory``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time


def _spin() -> None:  # the busy process
    while True:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["8x2048", "8x32768"])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=30, help="calls per round and thread count")
    p.add_argument("--no-busy", action="store_true", help="no busy process beside")
    args = p.parse_args()

    import torch

    import rlops
    from rlops.measure.timing import keep_freed_memory

    keep_freed_memory()  # as rlops bench: freed memory is kept, as a trainer's allocator does
    default = torch.get_num_threads()
    busy = None
    if not args.no_busy:
        busy = mp.get_context("spawn").Process(target=_spin, daemon=True)
        busy.start()
    try:
        print(f"torch threads: default {default}; busy process beside: {busy is not None}")
        print(f"{'function':<20} {'shape':<9} {'1 thread':>10} {f'{default} threads':>11} "
              f"{'ratio':>6}")
        g = torch.Generator().manual_seed(0)
        for shape in args.shapes:
            b, t = (int(s) for s in shape.split("x"))
            r, v = torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)
            fns = {
                "gae": lambda r=r, v=v: rlops.gae(r, v, gamma=1.0, lam=0.95, method="chunked"),
                "discounted_cumsum": lambda r=r: rlops.discounted_cumsum(
                    r, 0.99, method="chunked"),
            }
            for name, fn in fns.items():
                times: dict[int, list[float]] = {1: [], default: []}
                ratios = []
                for k in range(args.rounds + 1):
                    for n in (1, default):
                        torch.set_num_threads(n)
                        ts = []
                        for _ in range(args.calls):
                            t0 = time.perf_counter()
                            fn()
                            ts.append(time.perf_counter() - t0)
                        if k:  # the first round warms up
                            times[n].append(statistics.median(ts))
                    if k:
                        ratios.append(times[default][-1] / times[1][-1])
                torch.set_num_threads(default)
                one, many = statistics.median(times[1]), statistics.median(times[default])
                print(f"{name:<20} {shape:<9} {one * 1e3:>8.3f}ms {many * 1e3:>9.3f}ms "
                      f"{statistics.median(ratios):>6.2f}")
    finally:
        if busy is not None:
            busy.terminate()


if __name__ == "__main__":
    main()
