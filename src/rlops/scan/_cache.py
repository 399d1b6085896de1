"""numba's ``njit`` with an on-disk cache that processes may share (imported only where numba is
installed): :func:`njit`.

numba saves a compiled kernel by reading the function's cache index, taking the first free
data-file number, writing the index back, then the data. Two processes compiling different
signatures of one function at once (the ranks of a ``torchrun`` on one machine, the workers of
a test run) can take the same number: the index then maps one signature to the other's
machine code, and every later process that loads it calls code built for other argument
types (an unboxing error, or wrong memory read). Here a cache's save holds an exclusive lock
on a file beside it (``fcntl.flock``; where there is none, as on Windows, saves as numba
does), so that each save sees the index as the previous one left it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import numba
from numba.core.caching import FunctionCache

_LOCK_FILE = "rlops-numba-cache.lock"


@contextlib.contextmanager
def _exclusive(directory: str) -> Iterator[None]:
    """An exclusive lock on ``directory``'s lock file while the block runs (none where the
    file cannot be opened or there is no ``fcntl``: the block runs unlocked)."""
    try:
        import fcntl

        fd = os.open(os.path.join(directory, _LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o666)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class _LockedCache(FunctionCache):
    """numba's cache of one function, its saves under :func:`_exclusive`."""

    def save_overload(self, sig, data):
        with _exclusive(self._cache_path):
            super().save_overload(sig, data)


def njit(**options) -> Callable:
    """``numba.njit(cache=True, **options)`` with saves that processes may run at once (module
    docstring)."""

    def wrap(fn):
        dispatcher = numba.njit(cache=True, **options)(fn)
        dispatcher._cache = _LockedCache(dispatcher.py_func)
        return dispatcher

    return wrap
