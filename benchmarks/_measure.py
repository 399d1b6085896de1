"""Time and peak memory of one workload, each measured in a fresh process.

Self-contained (standard library + torch) so that a CLI can import it as it is.

Memory is the *peak resident set size* (``getrusage(RUSAGE_SELF).ru_maxrss``, the kernel's
high-water mark of the process's resident pages) during the first call of the step, minus the
high-water mark reached once the inputs exist. A tiny instance of the same workload runs first,
so that code paged in and threads started by a first call are not counted. This sees every
allocation torch makes on CPU (its CPU allocator is plain malloc, with no cache that could hide
a peak), and a fresh process has no high-water left by other work. Time is the median wall
time of repeated calls after warm-up.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["measure", "measure_in_fresh_process", "peak_rss_bytes"]

METHOD = (
    "memory: peak RSS high-water (getrusage ru_maxrss) in a fresh spawned process per variant, "
    "minus the high-water once its inputs exist; time: median wall time after warm-up"
)


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def measure(step: Callable[[], Any], *, repeats: int = 3, warmup: int = 1) -> dict[str, float]:
    """``{"peak_extra_bytes", "time_s", "times_s"}`` of ``step()``; call it in a fresh process
    right after building the inputs, so that the first call's peak is the step's own."""
    base = peak_rss_bytes()
    step()
    extra = peak_rss_bytes() - base
    for _ in range(max(warmup - 1, 0)):  # the first call above was a warm-up already
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"peak_extra_bytes": float(extra), "time_s": statistics.median(times),
            "times_s": times}


def _child(setup: Callable[..., Callable[[], Any]], kwargs: dict, prime_kwargs: dict | None,
           threads: int, repeats: int, warmup: int, results: Any) -> None:
    try:
        import torch

        torch.set_num_threads(threads)
        if prime_kwargs is not None:
            # Run the same code on tiny inputs first: the pages of code and the threads that a
            # first call brings in are then not counted as the workload's memory.
            setup(**prime_kwargs)()
        step = setup(**kwargs)
        results.put((True, measure(step, repeats=repeats, warmup=warmup)))
    except BaseException:
        results.put((False, traceback.format_exc()))


def measure_in_fresh_process(
    setup: Callable[..., Callable[[], Any]],
    kwargs: dict | None = None,
    *,
    prime_kwargs: dict | None = None,
    threads: int = 1,
    repeats: int = 3,
    warmup: int = 1,
    timeout: float = 900.0,
) -> dict[str, float]:
    """Spawn a process, build the workload with ``step = setup(**kwargs)`` and :func:`measure`.

    ``setup`` must be a module-level function (it is pickled); it allocates the inputs and
    returns the zero-argument step to measure. ``prime_kwargs``: a tiny instance of the same
    workload run first (and dropped) so that one-off costs of a first call stay out of the
    memory figure. Raises ``RuntimeError`` with the child's
    traceback if it fails, ``TimeoutError`` after ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child,
                       args=(setup, kwargs or {}, prime_kwargs, threads, repeats, warmup,
                             results))
    proc.start()
    try:
        ok, payload = results.get(timeout=timeout)
    except Exception as exc:
        raise TimeoutError(f"{setup.__name__} did not finish within {timeout} s") from exc
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    if not ok:
        raise RuntimeError(f"{setup.__name__} failed:\n{payload}")
    return payload
