"""CPU work split over a few Python threads, each running its share on one core.

torch's intra-op parallelism splits every operation over the cores and joins after it. A loop
of many small operations (the chunk loop of the fused log-probs) then waits at every join, and
when another process holds one of the cores each join waits for it: such a loop degrades far
more under contention than one large operation does. Splitting the *loop* instead — each
worker takes whole items and runs their operations single-threaded — joins once per loop, and
a worker that is slowed down simply takes fewer items.

torch's thread count is per thread: the workers set theirs to 1 when they start (and put back
the default that torch gives threads created later, which ``torch.set_num_threads`` also
sets). Between those two steps a thread created elsewhere would start with 1, so a pool starts
all its workers at once and waits for every one to be ready before its first item: the
default is back before the call that made the pool returns, and no worker starts later (a
lazily started one could reset the default in the middle of the caller's next statement).

A call made from a worker (nested) runs serially instead of waiting on its own pool. Each item
runs with the caller's grad and inference modes (thread-local too). When the items write
disjoint outputs the results are bitwise those of the serial loop, whatever thread runs which
item.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import torch

_state = threading.local()  # ``worker``: this thread is one of the pool's
_init_lock = threading.Lock()


def _one_thread() -> None:
    _state.worker = True
    with _init_lock:
        default = torch.get_num_threads()  # torch initialises this thread's count from it
        torch.set_num_threads(1)  # this thread's count, and the default for new threads...
        restore = threading.Thread(target=torch.set_num_threads, args=(default,))
        restore.start()  # ...which a throwaway thread puts back
        restore.join()


@functools.cache
def pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``workers`` threads, each running torch single-threaded, all
    started and initialised before it is returned."""
    executor = ThreadPoolExecutor(workers, thread_name_prefix="rlops", initializer=_one_thread)
    # One task per worker that waits for all the others: no task ends before every worker has
    # taken one, so the executor starts all ``workers`` threads (it starts a new one on each
    # submission while none is idle), and each has run its initializer once they all return.
    # If a worker fails to start, the barrier is broken so that the others do not wait forever.
    ready = threading.Barrier(workers)
    try:
        futures = [executor.submit(ready.wait) for _ in range(workers)]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in done:
            f.result()
    except BaseException:
        ready.abort()
        executor.shutdown(wait=False, cancel_futures=True)
        raise
    return executor


def for_each(body: Callable[[object], None], items: Iterable, device: torch.device) -> None:
    """``body(item)`` for every item: over :func:`pool` on CPU when torch's thread count (of the
    calling thread) is above 1 and there are several items, else (and under ``torch.compile``)
    in a plain loop. Exceptions
    propagate (the first item's that raised, after every item has run)."""
    items = list(items)
    # While torch.compile traces, the loop is unrolled into the graph (threads cannot be traced).
    serial = torch.compiler.is_compiling() or device.type != "cpu"
    workers = 1 if serial else torch.get_num_threads()
    if getattr(_state, "worker", False):
        workers = 1
    if workers <= 1 or len(items) <= 1:
        for item in items:
            body(item)
        return
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run(item: object) -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            body(item)

    futures = [pool(workers).submit(run, item) for item in items]
    _raise_first([f.exception() for f in futures])


def _raise_first(errors: list) -> None:
    # the first item's exception, once every item has run
    for e in errors:
        if e is not None:
            raise e


def split_with_caller(body: Callable[[object], None], items: Iterable) -> None:
    """``body(item)`` for every item, the first on the calling thread and the others over
    :func:`pool` (one worker to wake per item after the first, and the caller's core, whose
    caches hold what it just wrote, does a share); serially where :func:`for_each` would be.
    For bodies that run no torch op (compiled kernels): the caller's own thread count is not
    lowered while it runs its item. Exceptions propagate (the first item's that raised, after
    every item has run)."""
    items = list(items)
    workers = 1 if torch.compiler.is_compiling() else torch.get_num_threads()
    if getattr(_state, "worker", False) or workers <= 1 or len(items) <= 1:
        for item in items:
            body(item)
        return
    futures = [pool(workers).submit(body, item) for item in items[1:]]
    try:
        body(items[0])
    finally:
        errors = [f.exception() for f in futures]
    _raise_first(errors)
