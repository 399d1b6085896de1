"""Timing and peak-memory measurement for the command-line tools."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["PeakMemory", "sync", "time_median"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_median(
    fn: Callable[[], object],
    device: torch.device,
    *,
    repeats: int = 10,
    warmup: int = 1,
    budget_s: float = 2.0,
) -> float:
    """Median seconds of ``fn()`` over up to ``repeats`` runs (fewer if over ``budget_s``)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return statistics.median(times)


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak memory a block adds on top of what was live when it started, in bytes.

    CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``). CPU: the
    process's resident-set high-water mark (``VmHWM``), reset at entry through
    ``/proc/self/clear_refs``; it sees every allocation torch makes, plus any other growth of
    the process, so warm up (JIT, caches) before measuring. ``bytes`` is None where neither
    is available.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                self._base = _status_kib("VmRSS")
            except OSError:
                self._base = None
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            sync(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        elif self._base is not None:
            peak = _status_kib("VmHWM")
            self.bytes = None if peak is None else max(0, peak - self._base) * 1024
