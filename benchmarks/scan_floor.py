"""The CPU scan estimators against the allocating floor, at 1 and 2 threads.

    python benchmarks/scan_floor.py [--shapes 8x131072 256x8192] [--dtypes float32 bfloat16]
                                    [--rounds 30] [--no-chunked]
                                    [--keep-freed-memory | --map-large-blocks]

The allocating floor is what any function returning new tensors pays: ``torch.add(r, v)`` and
``r.clone()`` (read two ``[B, T]`` inputs, write two new outputs). For each shape and dtype,
every variant — the floor, ``gae`` (with and without a right-padded ``mask``),
``discounted_returns``, ``reinforce_plus_plus_returns``, ``discounted_cumsum``, with
``method="auto"`` (numba) and ``method="chunked"`` (the path without numba; its first 10
rounds, ``--chunked-rounds``) — is timed interleaved in this process: each round calls every
variant once at each thread count, the order reversed on odd rounds, and a variant's time is
the median over the rounds. Printed: each time and its ratio to the floor's time at the
same thread count, the ratio of its 2-thread time to its 1-thread time, its best time
against the floor's best (either count), and the median minor page faults of a call (first
touches of freshly mapped memory). glibc's malloc
keeps its defaults (as a user's process has them: whether a large output is mapped afresh
depends on the process's history) unless ``--keep-freed-memory`` (as ``rlops bench`` sets it:
never) or ``--map-large-blocks`` (always).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time


def variants(shape: str, dtype, chunked: bool) -> dict:
    import torch

    import rlops

    b, t = (int(s) for s in shape.split("x"))
    g = torch.Generator().manual_seed(0)
    r = torch.randn(b, t, generator=g).to(dtype)
    v = torch.randn(b, t, generator=g).to(dtype)
    kl = (torch.randn(b, t, generator=g) * 0.01).to(dtype)
    outcome = torch.randn(b, generator=g).to(dtype)
    lengths = torch.randint(t // 2, t + 1, (b, 1), generator=g)  # right-padded responses
    mask = torch.arange(t) < lengths
    fns = {"allocating floor": lambda: (torch.add(r, v), r.clone())}
    for method in ("auto", "chunked") if chunked else ("auto",):
        tag = "" if method == "auto" else " chunked"
        fns |= {
            f"gae{tag}": lambda m=method: rlops.gae(r, v, gamma=1.0, lam=0.95, method=m),
            f"gae mask{tag}": lambda m=method: rlops.gae(
                r, v, gamma=1.0, lam=0.95, mask=mask, method=m
            ),
            f"discounted_returns{tag}": lambda m=method: rlops.discounted_returns(
                r, gamma=0.99, method=m
            ),
            f"reinforce++ returns{tag}": lambda m=method: rlops.reinforce_plus_plus_returns(
                outcome, kl, mask, kl_coef=0.1, gamma=1.0, method=m
            ),
            f"discounted_cumsum{tag}": lambda m=method: rlops.discounted_cumsum(r, 0.99, method=m),
        }
    return fns


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(fns: dict, counts: tuple[int, ...], rounds: int, slow_rounds: int):
    """``({(key, n): median seconds}, {key: median page faults per call})``."""
    import torch

    times: dict = {(k, n): [] for k in fns for n in counts}
    faults: dict = {k: [] for k in fns}
    for n in counts:  # warm up (numba compiles, thread pools start) at every count
        torch.set_num_threads(n)
        for fn in fns.values():
            fn()
    for k in range(rounds):
        order_n = counts if k % 2 == 0 else counts[::-1]
        for n in order_n:
            torch.set_num_threads(n)
            keys = [key for key in fns if k < slow_rounds or "chunked" not in key]
            keys = keys if k % 2 == 0 else keys[::-1]
            for key in keys:
                f0, t0 = _faults(), time.perf_counter()
                fns[key]()
                times[key, n].append(time.perf_counter() - t0)
                faults[key].append(_faults() - f0)
    torch.set_num_threads(max(counts))
    med = {key: statistics.median(ts) for key, ts in times.items()}
    return med, {key: statistics.median(f) for key, f in faults.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["8x131072", "256x8192"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--chunked-rounds", type=int, default=10, help="rounds of the chunked path")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--no-chunked", action="store_true", help="leave out method='chunked'")
    p.add_argument("--keep-freed-memory", action="store_true", help="as rlops bench")
    p.add_argument(
        "--map-large-blocks", action="store_true", help="every large block mapped afresh"
    )
    args = p.parse_args()

    import torch

    from rlops.measure.timing import keep_freed_memory, map_large_blocks

    malloc = "glibc defaults"
    if args.keep_freed_memory:
        keep_freed_memory()
        malloc = "freed memory kept"
    elif args.map_large_blocks:
        map_large_blocks()
        malloc = "large blocks mapped afresh (faulted in on every call)"
    counts = tuple(args.threads)
    print(
        f"malloc: {malloc}; "
        f"median of {args.rounds} interleaved rounds; ratio = time / allocating floor"
    )
    head = "".join(f" {f'{n} thr':>9} {'×floor':>6}" for n in counts)
    for shape in args.shapes:
        for name in args.dtypes:
            dtype = getattr(torch, name)
            fns = variants(shape, dtype, not args.no_chunked)
            med, faults = measure(fns, counts, args.rounds, args.chunked_rounds)
            floor = {n: med["allocating floor", n] for n in counts}
            print(f"\n{shape} {name} (×floor: to the allocating floor at the same count)")
            print(f"{'call':<28}{head} {'2/1':>5} {'best×':>6} {'faults':>7}")
            for key in fns:
                cells = "".join(
                    f" {med[key, n] * 1e3:>7.3f}ms {med[key, n] / floor[n]:>6.2f}" for n in counts
                )
                ratio = med[key, counts[-1]] / med[key, counts[0]]
                best = min(med[key, n] for n in counts) / min(floor.values())
                print(f"{key:<28}{cells} {ratio:>5.2f} {best:>6.2f} {faults[key]:>7.0f}")


if __name__ == "__main__":
    main()
