"""Run a function on real multi-process torch.distributed groups, for tests.

    from tests._distributed import count_collectives, run_distributed

    def _work(rank, world_size, x):          # module level, in a test file
        with count_collectives() as calls:
            dist.all_reduce(y := x.clone())
        return {"y": y, "calls": dict(calls)}

    results = run_distributed(_work, 2, torch.ones(3))   # one result per rank, in rank order

What it does:

- spawns ``world_size`` fresh processes (``multiprocessing`` spawn context), each joins a Gloo
  process group on 127.0.0.1 through a TCP store that the parent serves on a free port (the OS
  picks it, so parallel test runs cannot collide), then calls ``fn(rank, world_size, *args,
  **kwargs)`` with ``torch.set_num_threads(1)``;
- returns what each rank returned (anything ``torch.save`` can store), in rank order;
- an exception in a rank is raised in the parent as :class:`RankError` with that rank's
  traceback, and the other ranks are killed at once (they may be blocked in a collective);
- a rank that dies without reporting, or a group that does not finish within ``timeout``
  seconds (a hang: mismatched collectives, a rank that skipped one), kills every rank and raises
  ``TimeoutError`` / :class:`RankError` instead of blocking the test run.

``fn`` and its arguments are pickled, so ``fn`` must be a module-level function of an importable
module (a test file is fine). :func:`count_collectives` counts the torch.distributed calls made
inside it, in the process where it runs (use it inside ``fn``).

**Warm groups.** Starting a group costs seconds (each process imports torch and joins the
group), more than most checks. So the ranks of a group stay up between calls: the next
``run_distributed`` with the same ``world_size`` in this process sends its function to the same
ranks. Each call starts as a fresh process would: the environment as it was before the call
(variables a call sets are put back), one intra-op thread, float32 as the default dtype,
gradients on (torch's seed is random in a fresh process too: seed what a check draws). After
each call the ranks check that they are in step (one small ``all_gather`` of the call's
number): a call that leaves a collective unmatched fails there, not in the next test. Any
failure or timeout ends the group; the next call starts a new one. A function that patches
module state (a module attribute replaced for counting, say) passes ``fresh=True``: it runs in
a group of its own, which ends with it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import io
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["COLLECTIVES", "RankError", "count_collectives", "run_distributed"]

# Every torch.distributed call that communicates (collectives and point-to-point).
COLLECTIVES = (
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "_all_gather_base",
    "_reduce_scatter_base",
)


class RankError(RuntimeError):
    """A rank raised (its traceback is in the message) or died without reporting."""


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count calls to the torch.distributed communication functions made inside the block.

    Patches the names in :data:`COLLECTIVES` on ``torch.distributed`` and its
    ``distributed_c10d`` module (so code calling ``dist.<name>`` is seen), yields a
    ``Counter`` of ``name -> calls``, and restores the originals on exit. A call that is
    implemented through another patched one (``all_gather_object`` → ``all_gather``) counts
    once, under the outer name.
    """
    calls: Counter = Counter()
    modules = (dist, dist.distributed_c10d)
    originals = {}
    depth = [0]

    def wrap(name: str, original: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                calls[name] += 1
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for module in modules:
        for name in COLLECTIVES:
            if hasattr(module, name):
                original = getattr(module, name)
                originals[(module, name)] = original
                setattr(module, name, wrap(name, original))
    try:
        yield calls
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)


_SYNC_TIMEOUT = datetime.timedelta(seconds=600)  # a warm group's own; calls have theirs


def _join(rank: int, world_size: int, port: int, timeout: datetime.timedelta) -> None:
    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


def _warm_child(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    """A rank of a warm group: run the calls it is sent until told to stop (None) or one fails."""
    try:
        _join(rank, world_size, port, _SYNC_TIMEOUT)
    except BaseException:
        results.put((-1, rank, False, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        number, fn, args, kwargs = task
        env = dict(os.environ)
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        try:
            out = fn(rank, world_size, *args, **kwargs)
            buf = io.BytesIO()
            torch.save(out, buf)
            os.environ.clear()
            os.environ.update(env)
            mine = torch.tensor([number], dtype=torch.int64)
            seen = [torch.zeros_like(mine) for _ in range(world_size)]
            dist.all_gather(seen, mine)
            if any(int(x) != number for x in seen):
                raise RuntimeError(
                    f"the ranks are out of step after this call: their call numbers "
                    f"{[int(x) for x in seen]} (a collective left unmatched on some rank)"
                )
        except BaseException:
            results.put((number, rank, False, traceback.format_exc()))
            return  # leaving ends the group: the others' collectives fail instead of waiting
        results.put((number, rank, True, buf.getvalue()))
    dist.destroy_process_group()


class _WarmGroup:
    """``world_size`` ranks in a Gloo group that run the calls sent to them in turn."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            world_size + 1,
            is_master=True,
            timeout=_SYNC_TIMEOUT,
            wait_for_workers=False,
        )
        self.calls = 0
        self.procs = _spawn(
            ctx,
            _warm_child,
            [
                (r, world_size, self.store.port, self.tasks[r], self.results)
                for r in range(world_size)
            ],
        )

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        self.calls += 1
        for q in self.tasks:
            q.put((self.calls, fn, args, kwargs))
        return _collect(self.procs, self.results, self.world_size, timeout, self.calls)

    def close(self, kill: bool = False) -> None:
        for q in self.tasks:
            if not kill:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0.1 if kill else 5)
            if p.is_alive():
                p.kill()
                p.join()
        for q in (*self.tasks, self.results):
            q.close()


_WARM: dict[int, _WarmGroup] = {}


@atexit.register
def _close_warm_groups() -> None:
    while _WARM:
        _WARM.popitem()[1].close()


def _spawn(ctx: Any, target: Callable, arg_lists: list[tuple]) -> list[Any]:
    """Start one daemon process per argument tuple, with this module's root on ``sys.path``."""
    root = _import_root()
    added = root not in sys.path
    if added:  # children inherit sys.path: let them import this module and fn's module
        sys.path.insert(0, root)
    procs = []
    try:
        for args in arg_lists:
            p = ctx.Process(target=target, args=args, daemon=True)
            p.start()
            procs.append(p)
    finally:
        if added:
            sys.path.remove(root)
    return procs


def _collect(
    procs: list[Any], results: Any, world_size: int, timeout: float, number: int | None
) -> list[Any]:
    """Every rank's result for call ``number`` (None: the only call), in rank order."""
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(out) < world_size:
        try:
            got = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
            if dead:
                time.sleep(0.5)  # a report may still be in flight
                if results.empty():
                    raise RankError(
                        f"rank {dead[0]} exited with code "
                        f"{procs[dead[0]].exitcode} without reporting"
                    ) from None
                continue
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(
                    f"ranks {missing} of {world_size} did not finish within {timeout} s "
                    "(a hang: mismatched or missing collective?)"
                ) from None
            continue
        if number is None:
            rank, ok, payload = got
        else:
            n, rank, ok, payload = got
            if n not in (number, -1):
                continue  # cannot happen: a group ends at its first failure
        if not ok:
            raise RankError(_failures(rank, payload, results, world_size))
        out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [out[r] for r in range(world_size)]


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: tuple,
    kwargs: dict,
    results: Any,
    timeout: float,
) -> None:
    try:
        _join(rank, world_size, port, datetime.timedelta(seconds=timeout))
        try:
            out = fn(rank, world_size, *args, **kwargs)
            buf = io.BytesIO()
            torch.save(out, buf)
            results.put((rank, True, buf.getvalue()))
        except BaseException:
            # Report before leaving the group: the other ranks' errors that our exit causes
            # ("connection closed by peer") then arrive after the cause.
            results.put((rank, False, traceback.format_exc()))
            return
        finally:
            dist.destroy_process_group()
    except BaseException:  # setting up the group failed
        results.put((rank, False, traceback.format_exc()))


def _import_root() -> str:
    """The sys.path entry from which this module is importable under its own ``__name__``."""
    return str(Path(__file__).resolve().parents[__name__.count(".")])


def _failures(rank: int, payload: str, results: Any, world_size: int) -> str:
    """The first failure, then any other rank's that arrives within a second (often caused by
    the first one leaving the group)."""
    msgs = [f"rank {rank} of {world_size} raised:\n{payload}"]
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            r, ok, more = results.get(timeout=0.1)[-3:]  # (call number,) rank, ok, payload
        except queue.Empty:
            continue
        if not ok:
            msgs.append(f"then rank {r} raised:\n{more}")
    return "\n".join(msgs)


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    fresh: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` Gloo ranks; see module doc.

    Returns the ranks' return values in rank order. Raises :class:`RankError` if a rank raises
    or dies, ``TimeoutError`` if they do not all finish within ``timeout`` seconds. The ranks
    of a warm group run it unless ``fresh`` (then new processes, which end with the call).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if fresh:
        return _run_fresh(fn, world_size, args, kwargs, timeout)
    group = _WARM.get(world_size)
    if group is None:
        group = _WARM[world_size] = _WarmGroup(world_size)
    try:
        return group.run(fn, args, kwargs, timeout)
    except BaseException:
        del _WARM[world_size]
        group.close(kill=True)
        raise


def _run_fresh(
    fn: Callable, world_size: int, args: tuple, kwargs: dict, timeout: float
) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    delta = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size + 1, is_master=True, timeout=delta, wait_for_workers=False
    )
    procs = _spawn(
        ctx,
        _child,
        [
            (r, world_size, store.port, fn, args, kwargs, results, timeout)
            for r in range(world_size)
        ],
    )
    done = False
    try:
        out = _collect(procs, results, world_size, timeout, None)
        done = True
        return out
    finally:
        for p in procs:
            p.join(timeout=5 if done else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        del store
