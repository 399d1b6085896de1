"""Timing and peak-memory measurement for ``rlops bench | profile`` and ``benchmarks/``.

Two ways to see peak memory on CPU, where torch has no allocator statistics:

* :class:`PeakMemory`, in this process: the resident-set high-water mark, reset on entry
  through ``/proc/self/clear_refs`` (Linux). Cheap; warm up first so one-off costs (JIT, code
  pages, thread pools) are not counted.
* :func:`measure_in_fresh_process`: a spawned process builds the inputs and runs the step once;
  its resident-set high-water mark minus the high-water once the inputs exist. A tiny
  instance of the same workload runs first, so code paged in by a first call is not counted.
  This sees every allocation torch makes on CPU (plain malloc, no cache to hide a peak).
  :func:`peak_in_fresh_process` measures the memory alone, with large blocks mapped and
  unmapped as they come and go (:func:`map_large_blocks`), so that a figure repeats.

Time is always the median wall time of repeated calls after warm-up. What is compared is timed
interleaved (:func:`time_interleaved`, in this process or a fresh one with
:func:`time_in_fresh_process`): each repeat calls every method once, in turn, so a neighbour's
burst of load falls on all of them alike instead of on whichever block ran then. A time can be
taken at several torch thread counts, interleaved too: a loop of many small operations can
wait at every intra-op join while another process holds a core, so one thread can beat many,
and a comparison is only fair between each method's faster count. :func:`torch_threads` sets
the count for a block and puts it back after.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

__all__ = [
    "METHOD",
    "PeakMemory",
    "keep_freed_memory",
    "map_large_blocks",
    "measure",
    "measure_in_fresh_process",
    "peak_in_fresh_process",
    "peak_rss_bytes",
    "run_in_fresh_process",
    "sync",
    "time_by_threads",
    "time_in_fresh_process",
    "time_interleaved",
    "time_median",
    "torch_threads",
    "variants_in_fresh_processes",
]

K = TypeVar("K")
# A workload built in a fresh process: (module-level setup, its kwargs, a tiny prime's kwargs).
Setup = tuple[Callable[..., Callable[[], Any]], dict, dict | None]


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


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with torch's intra-op thread count (of the calling thread) at ``n``
    (``None``: unchanged); the count it had is put back when the block ends, however it ends."""
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def time_by_threads(
    fn: Callable[[], object], device: torch.device, counts: Sequence[int], **kwargs: Any
) -> dict[int, float]:
    """``{n: time_median(fn, device, **kwargs)}`` with ``n`` torch threads, for each count."""
    out = {}
    for n in counts:
        with torch_threads(n):
            out[n] = time_median(fn, device, **kwargs)
    return out


def _each(value: int | Mapping[K, int], key: K) -> int:
    return value if isinstance(value, int) else value[key]


def time_interleaved(
    fns: Mapping[K, Callable[[], object]],
    device: torch.device,
    counts: Sequence[int | None] = (None,),
    *,
    repeats: int | Mapping[K, int] = 5,
    warmup: int | Mapping[K, int] = 1,
    budget_s: float = 0.0,
    max_repeats: int = 100,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[K, dict[int, float]]:
    """``{key: {n: median seconds}}`` of each ``fns[key]()`` at each torch thread count ``n``
    (``None``: torch's count as it is), timed interleaved.

    First ``warmup`` calls of each function at the largest count. Then in repeat ``r``, for
    each count (set for that block and put back after), each function with repeats left is
    called and timed once; odd repeats go through the counts and the functions in reverse
    order (A B, B A), so neither is always the one that runs after the other. ``repeats``
    and ``warmup``: one number for every function or one per key (a slow baseline may run
    once while the others repeat). ``budget_s``: at each count, each function repeats more,
    as many times (up to ``max_repeats``) as its calls at the first repeat's pace fit in its
    share of ``budget_s`` (split evenly over the counts): a function of a few milliseconds gets
    enough calls for a median that a burst of load cannot move, while a slow one (or one
    stalled at a count) keeps its ``repeats``. ``clock``: seconds, for tests.
    """
    order = list(fns)
    known = [n for n in counts if n is not None]
    with torch_threads(max(known) if known else None):
        for key in order:
            for _ in range(_each(warmup, key)):
                fns[key]()
        sync(device)
    times: dict[K, dict[int, list[float]]] = {key: {} for key in order}
    cells = [(key, i) for key in order for i in range(len(counts))]
    runs = {(key, i): _each(repeats, key) for key, i in cells}
    share = budget_s / max(len(counts), 1)
    r = 0
    while any(r < runs[cell] for cell in cells):
        flip = -1 if r % 2 else 1
        for i in list(range(len(counts)))[::flip]:
            with torch_threads(counts[i]):
                at = torch.get_num_threads()
                for key in order[::flip]:
                    if r >= runs[key, i]:
                        continue
                    t0 = clock()
                    fns[key]()
                    sync(device)
                    times[key].setdefault(at, []).append(clock() - t0)
                    if r == 0 and share > 0:
                        pace = times[key][at][0]
                        fit = int(share / pace) if pace > 0 else max_repeats
                        runs[key, i] = max(runs[key, i], min(max_repeats, fit))
        r += 1
    return {
        key: {n: statistics.median(ts) for n, ts in sorted(by.items())} for key, by in times.items()
    }


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as a long-running trainer's allocator behaves: large blocks come
    from the heap and freed memory is kept (``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD`` = 1 GiB).

    With glibc's defaults, whether a 4 MiB tensor is ``mmap``-ed afresh (and page-faulted in
    on every call) depends on what the process allocated before; in one process a memory-bound
    op then ran 2-4x slower than in another. Timings taken after this call do not depend on
    that history. :class:`PeakMemory` still sees peaks (it returns free pages first). Returns
    whether the tuning applied (False off glibc).
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(
            libc.mallopt(m_trim_threshold, 1 << 30)
        )
    except (OSError, AttributeError):
        return False


def _release_free_heap() -> None:
    """Return freed heap pages to the system (glibc ``malloc_trim``), so that a block's new
    allocations raise the resident size instead of silently reusing freed pages."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


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
        self._base: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            _release_free_heap()
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                self._base = _status_kib("VmRSS")
            except OSError:
                self._base = None
        return self

    def __exit__(self, *exc) -> None:
        if self._base is None:
            return
        if self.device.type == "cuda":
            sync(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            peak = _status_kib("VmHWM")
            self.bytes = None if peak is None else max(0, peak - self._base) * 1024


METHOD = (
    "memory: peak RSS high-water (VmHWM) in a fresh spawned process per variant, "
    "minus the high-water once its inputs exist; time: median wall time after warm-up, "
    "malloc keeping freed memory"
)


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far, in bytes.

    Linux: ``VmHWM``, the high-water of this process's own memory map. Not ``ru_maxrss``:
    that one carries over ``exec`` the resident size of the forked parent, so a spawned child
    of a large parent would see no growth below the parent's size. Elsewhere ``ru_maxrss``.
    """
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _first_call_peak(step: Callable[[], Any]) -> int:
    """Bytes the process's resident high-water rises by over one call of ``step``."""
    base = peak_rss_bytes()
    step()
    return peak_rss_bytes() - base


def measure(
    step: Callable[[], Any],
    *,
    repeats: int = 3,
    warmup: int = 1,
    threads: Sequence[int] = (),
) -> dict[str, Any]:
    """``{"peak_extra_bytes", "time_s", "times_s"}`` of ``step()``; call it in a fresh process
    right after building the inputs, so that the first call's peak is the step's own.
    ``threads``: time it at each of these torch thread counts in turn (the count is put back
    after), ``"time_s_by_threads"``: ``{n: median seconds}``; ``time_s`` is the first count's.
    Only the first count is warmed up: give the largest first (no new threads to start after).

    The first call measures the memory, with the allocator as the process found it. Then
    glibc's malloc is set to keep freed memory (:func:`keep_freed_memory`, as ``rlops bench``
    does) and ``warmup`` more calls run before the timed ones: the times then count the work,
    not the page faults of blocks ``mmap``-ed afresh on every call (which glibc does for any
    block over 32 MiB whatever it allocated before, e.g. one ``[chunk, V]`` buffer).
    """
    extra = _first_call_peak(step)
    keep_freed_memory()
    by_threads: dict[int, list[float]] = {}
    for k, n in enumerate(threads or [None]):
        with torch_threads(n):
            for _ in range(max(warmup, 1) if k == 0 else 0):
                step()
            times = by_threads.setdefault(n or torch.get_num_threads(), [])
            for _ in range(repeats):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
    first = next(iter(by_threads.values()))
    out = {"peak_extra_bytes": float(extra), "time_s": statistics.median(first), "times_s": first}
    if threads:
        out["time_s_by_threads"] = {n: statistics.median(t) for n, t in by_threads.items()}
    return out


def _child(fn: Callable[..., Any], args: tuple, results: Any) -> None:
    try:
        results.put((True, fn(*args)))
    except BaseException:
        results.put((False, traceback.format_exc()))


def run_in_fresh_process(
    fn: Callable[..., Any], *args: Any, name: str | None = None, timeout: float = 900.0
) -> Any:
    """``fn(*args)`` in a spawned process, and what it returns. ``fn`` must be a module-level
    function and ``args`` picklable. Raises ``RuntimeError`` with the child's traceback if it
    fails, ``TimeoutError`` after ``timeout`` seconds (``name``: what the messages call it)."""
    name = name or fn.__name__
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, results))
    proc.start()
    try:
        ok, payload = results.get(timeout=timeout)
    except Exception as exc:
        raise TimeoutError(f"{name} did not finish within {timeout} s") from exc
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    if not ok:
        raise RuntimeError(f"{name} failed:\n{payload}")
    return payload


def _build(
    setup: Callable[..., Callable[[], Any]], kwargs: dict, prime_kwargs: dict | None
) -> Callable[[], Any]:
    if prime_kwargs is not None:
        # Run the same code on tiny inputs first: the pages of code and the threads that a
        # first call brings in are then not counted as the workload's memory.
        setup(**prime_kwargs)()
    return setup(**kwargs)


def _measure_job(
    setup: Callable[..., Callable[[], Any]],
    kwargs: dict,
    prime_kwargs: dict | None,
    threads: int | Sequence[int],
    repeats: int,
    warmup: int,
) -> dict[str, Any]:
    counts = [threads] if isinstance(threads, int) else list(threads)
    torch.set_num_threads(counts[0])  # this child's own count: nothing to put back
    step = _build(setup, kwargs, prime_kwargs)
    each = [] if isinstance(threads, int) else counts
    return measure(step, repeats=repeats, warmup=warmup, threads=each)


def measure_in_fresh_process(
    setup: Callable[..., Callable[[], Any]],
    kwargs: dict | None = None,
    *,
    prime_kwargs: dict | None = None,
    threads: int | Sequence[int] = 1,
    repeats: int = 3,
    warmup: int = 1,
    timeout: float = 900.0,
) -> dict[str, Any]:
    """Spawn a process, build the workload with ``step = setup(**kwargs)`` and :func:`measure`.

    ``threads``: torch's thread count there; a sequence of counts: the first for the memory and
    ``time_s``, and the time at each in ``"time_s_by_threads"``.

    ``setup`` must be a module-level function (it is pickled); it allocates the inputs and
    returns the zero-argument step to measure. ``prime_kwargs``: a tiny instance of the same
    workload run first (and dropped) so that one-off costs of a first call stay out of the
    memory figure. Raises ``RuntimeError`` with the child's
    traceback if it fails, ``TimeoutError`` after ``timeout`` seconds.
    """
    args = (setup, kwargs or {}, prime_kwargs, threads, repeats, warmup)
    return run_in_fresh_process(_measure_job, *args, name=setup.__name__, timeout=timeout)


def map_large_blocks(threshold: int = 128 << 10) -> bool:
    """Have glibc's malloc ``mmap`` every block of ``threshold`` bytes or more on allocation
    and unmap it on free (a fixed ``M_MMAP_THRESHOLD``), so that the resident size follows the
    live large tensors exactly. With glibc's default the threshold moves with what the process
    freed before (up to 32 MiB), and a freed block kept in the heap or not moved a peak by tens
    of MiB between two runs of the same step. For memory measurement only: every such block is
    then page-faulted in afresh. Returns whether it applied (False off glibc)."""
    try:
        import ctypes

        m_mmap_threshold = -3
        return bool(ctypes.CDLL(None).mallopt(m_mmap_threshold, threshold))
    except (OSError, AttributeError):
        return False


def _peak_job(
    setup: Callable[..., Callable[[], Any]], kwargs: dict, prime_kwargs: dict | None, threads: int
) -> int:
    torch.set_num_threads(threads)  # this child's own count: nothing to put back
    map_large_blocks()
    return _first_call_peak(_build(setup, kwargs, prime_kwargs))


def peak_in_fresh_process(
    setup: Callable[..., Callable[[], Any]],
    kwargs: dict | None = None,
    *,
    prime_kwargs: dict | None = None,
    threads: int = 1,
    timeout: float = 900.0,
) -> int:
    """The peak extra bytes of one call of ``setup(**kwargs)``'s step, in a spawned process at
    ``threads`` torch threads: the first call's rise of the resident high-water once the inputs
    exist (after the tiny ``prime_kwargs`` instance, as :func:`measure_in_fresh_process`), and
    no timing. Large blocks are mapped and unmapped as they come and go
    (:func:`map_large_blocks`): the same step gives the same figure, to a fraction of a MiB,
    run after run (with glibc's defaults it moved by up to 60 MiB at 2048 x 32000)."""
    args = (setup, kwargs or {}, prime_kwargs, threads)
    return run_in_fresh_process(_peak_job, *args, name=setup.__name__, timeout=timeout)


def _time_job(
    setups: Mapping[str, Setup], counts: Sequence[int], repeats: int, warmup: int, budget_s: float
) -> dict[str, dict[int, float]]:
    torch.set_num_threads(max(counts))  # this child's own count: nothing to put back
    keep_freed_memory()
    steps = {key: _build(setup, kw, prime) for key, (setup, kw, prime) in setups.items()}
    cpu = torch.device("cpu")
    return time_interleaved(steps, cpu, counts, repeats=repeats, warmup=warmup, budget_s=budget_s)


def time_in_fresh_process(
    setups: Mapping[str, Setup],
    counts: Sequence[int],
    *,
    repeats: int = 3,
    warmup: int = 1,
    budget_s: float = 0.0,
    timeout: float = 900.0,
) -> dict[str, dict[int, float]]:
    """``{key: {n: median seconds}}``: a spawned process builds every ``setup(**kwargs)`` of
    ``setups`` (``key: (setup, kwargs, prime_kwargs)``, each after its tiny prime instance),
    sets malloc to keep freed memory (:func:`keep_freed_memory`), and times the steps
    :func:`time_interleaved` at each of ``counts`` (``repeats``, ``warmup``, ``budget_s``: its
    arguments). The memory is measured elsewhere
    (:func:`peak_in_fresh_process`): here the inputs of every step are live at once."""
    name = " / ".join(setup.__name__ for setup, _, _ in setups.values())
    args = (dict(setups), list(counts), repeats, warmup, budget_s)
    return run_in_fresh_process(_time_job, *args, name=name, timeout=timeout)


def variants_in_fresh_processes(
    setup: Callable[..., Callable[[], Any]],
    variants: Sequence[str],
    kwargs: dict,
    prime_kwargs: dict,
    *,
    threads: int = 1,
    repeats: int = 5,
) -> dict[str, tuple[float, int]]:
    """``{variant: (median seconds, peak extra bytes)}`` of ``setup(**kwargs, variant=v)``'s
    steps: the peaks one fresh process each (:func:`peak_in_fresh_process`), the times
    interleaved in one (:func:`time_in_fresh_process`), at ``threads`` torch threads."""
    setups = {
        v: (setup, {**kwargs, "variant": v}, {**prime_kwargs, "variant": v}) for v in variants
    }
    peaks = {
        v: peak_in_fresh_process(fn, kw, prime_kwargs=prime, threads=threads)
        for v, (fn, kw, prime) in setups.items()
    }
    times = time_in_fresh_process(setups, [threads], repeats=repeats)
    return {v: (times[v][threads], peaks[v]) for v in variants}
