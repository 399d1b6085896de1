"""numba's on-disk cache shared by processes that compile at once (``rlops.scan._cache.njit``): four
processes compile the same 30 signatures of one function, in different orders, into one cache
directory; a fresh process then loads every signature from it and each gives its own result.

With numba's own ``cache=True`` two processes saving different signatures at once can take the
same data file, so that the index maps a signature to another's machine code ("can't unbox
array", or wrong memory read, in every process that loads it afterwards); the lock around a
save keeps each save's view of the index whole.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.tolerances import needs_numba

pytestmark = needs_numba

_MODULE = """
from rlops.scan._cache import njit

@njit()
def f(x):
    return x.ndim * 1000 + x.itemsize * 10
"""

_DRIVER = """
import sys
import numpy as np
import kernel

DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
          np.float32, np.float64]
SIGS = [(d, n) for d in DTYPES for n in (1, 2, 3)]
if sys.argv[1] == "compile":
    k = int(sys.argv[2])
    order = SIGS[k % 2::2] + SIGS[1 - k % 2::2]
    for d, n in order[::-1] if k >= 2 else order:
        kernel.f(np.ones((1,) * n, d))
else:
    bad = []
    for d, n in SIGS:
        try:
            got = kernel.f(np.ones((1,) * n, d))
        except Exception as e:
            got = repr(e)
        if got != n * 1000 + np.dtype(d).itemsize * 10:
            bad.append((np.dtype(d).name, n, got))
    print(bad)
"""


def test_processes_compiling_at_once_leave_a_whole_cache(tmp_path: Path):
    (tmp_path / "kernel.py").write_text(textwrap.dedent(_MODULE))
    (tmp_path / "driver.py").write_text(textwrap.dedent(_DRIVER))
    src = Path(__file__).resolve().parents[2] / "src"
    paths = os.pathsep.join([str(tmp_path), str(src)])
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": paths}
    for trial in range(2):
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
        procs = [
            subprocess.Popen(
                [sys.executable, "driver.py", "compile", str(k)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for k in range(4)
        ]
        for p in procs:
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0, (trial, out[-2000:])
        check = subprocess.run(
            [sys.executable, "driver.py", "check"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert check.returncode == 0, check.stderr[-2000:]
        assert check.stdout.strip() == "[]", (trial, check.stdout)


def test_the_lock_is_taken_and_released(tmp_path: Path):
    from rlops.scan._cache import _LOCK_FILE, _exclusive

    with _exclusive(str(tmp_path)):
        assert (tmp_path / _LOCK_FILE).exists()
    with _exclusive(str(tmp_path)):  # released: taken again at once
        pass
    with _exclusive(str(tmp_path / "missing")):  # no lock file possible: the block still runs
        pass


@pytest.mark.parametrize("name", ["rlops.scan.tiles", "rlops.scan._numba_kernels"])
def test_the_kernels_take_the_locked_cache(name):
    import importlib

    from rlops.scan._cache import _LockedCache

    mod = importlib.import_module(name)
    dispatchers = [f for f in vars(mod).values() if hasattr(f, "_cache") and hasattr(f, "py_func")]
    assert dispatchers
    cached = [f for f in dispatchers if type(f._cache).__name__ != "NullCache"]
    assert cached and all(isinstance(f._cache, _LockedCache) for f in cached)
