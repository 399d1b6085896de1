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
module (a test file is fine). Spawning costs about a second per process on a small machine:
do several checks per spawn. :func:`count_collectives` counts the torch.distributed calls made
inside it, in the process where it runs (use it inside ``fn``).
"""

from __future__ import annotations

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
        torch.set_num_threads(1)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        delta = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=delta)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=delta
        )
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
            r, ok, more = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if not ok:
            msgs.append(f"then rank {r} raised:\n{more}")
    return "\n".join(msgs)


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 60.0, **kwargs: Any
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` Gloo ranks; see module doc.

    Returns the ranks' return values in rank order. Raises :class:`RankError` if a rank raises
    or dies, ``TimeoutError`` if they do not all finish within ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    delta = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size + 1, is_master=True, timeout=delta, wait_for_workers=False
    )
    root = _import_root()
    added = root not in sys.path
    if added:  # children inherit sys.path: let them import this module and fn's module
        sys.path.insert(0, root)
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_child,
                args=(rank, world_size, store.port, fn, args, kwargs, results, timeout),
                daemon=True,
            )
            p.start()
            procs.append(p)
    finally:
        if added:
            sys.path.remove(root)
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.2)
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
            if not ok:
                raise RankError(_failures(rank, payload, results, world_size))
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        del store
    return [out[r] for r in range(world_size)]
