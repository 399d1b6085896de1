"""The compiled kernels' shares run by torch's own OpenMP threads (numba; imported only where it
is installed): :func:`available`, :func:`run`.

A share handed to a Python thread pool waits for that thread to wake (0.1-0.2 ms on the 2-core
VM), and where torch's OpenMP workers still spin after an op (libgomp spins for a while before
it sleeps) the pool's thread and the spinning one share a core: the split ran no faster than one
thread. torch's OpenMP team instead picks the shares up at once, on the threads torch itself
uses: :func:`run` opens a parallel region of that runtime (``GOMP_parallel``, which GNU's
libgomp and LLVM's libomp both export) on a compiled function (a numba ``cfunc``, one per
kernel and argument types, in a module file of its own so that numba caches it on disk) that
takes the shares one at a time (an atomic counter) and calls the kernel on each, without the
GIL. Where torch does not run on OpenMP, or the runtime lacks
the entry point, :func:`available` is False and the callers use the pool.
"""

from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core.dispatcher import Dispatcher
from numba.extending import intrinsic


@functools.cache
def _gomp_parallel():
    """``GOMP_parallel`` of the OpenMP runtime torch runs on, or None."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:  # the symbol as torch's own libraries resolve it: their runtime, not another one
        fn = ctypes.CDLL(torch._C.__file__).GOMP_parallel
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    fn.restype = None
    return fn


def available(kernel) -> bool:
    """Whether :func:`run` can run ``kernel``'s shares: a numba kernel, and torch's OpenMP
    runtime found."""
    return isinstance(kernel, Dispatcher) and _gomp_parallel() is not None


@intrinsic
def _pointer(typingctx, address):
    """An integer address as a ``void *``."""

    def codegen(context, b, signature, args):
        return b.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.int64), codegen


@intrinsic
def _claim(typingctx, address):
    """Atomically add 1 to the ``int64`` at ``address``; its value before."""

    def codegen(context, b, signature, args):
        counter = b.inttoptr(args[0], ir.IntType(64).as_pointer())
        return b.atomic_rmw("add", counter, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(types.int64), codegen


_HEAD = 2  # the header's first slots: the share counter, the number of shares


def _header(args: tuple, parts: Sequence[tuple]) -> array.array:
    """``int64`` slots: the counter and the number of shares, then each array
    argument's address and shape (nothing for None), then the shares' ints."""
    slots: list[int] = [0, len(parts)]
    for a in args:
        if a is not None:
            slots += [a.ctypes.data, *a.shape]
    for part in parts:
        slots += part
    return array.array("q", slots)


#: the arrays the kernels take for a tensor's dtype: bfloat16 as its bits
_NUMPY = {
    torch.bfloat16: np.dtype(np.uint16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.bool: np.dtype(np.bool_),
}


_lock = threading.Lock()
_bodies: dict = {}
_calls: dict = {}  # the bodies as ctypes functions (the GIL released while they run)


def _body(kernel: Dispatcher, key: tuple, args: tuple, per_share: int):
    """The ``cfunc`` running ``kernel``'s shares for arguments like ``args`` (numpy arrays or
    tensors; ``key`` names their dtypes and dimensions): made once per signature, in a module
    of its own that numba caches on disk (:func:`_load`), looked up in each process by
    ``key`` (``numba.typeof`` of ten arrays took 0.1 ms when the caches were cold), with a
    ``ctypes`` function calling it on the calling thread."""
    body = _bodies.get(key)
    if body is None:
        with _lock:
            if key not in _bodies:
                specs = tuple(None if a is None else _spec(a) for a in args)
                fn = _compile_body(kernel, specs, per_share)
                _calls[key] = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn.address)
                _bodies[key] = fn
            body = _bodies[key]
    return body


def _spec(a) -> tuple:
    # an array's or a tensor's numpy dtype (bfloat16: its bits) and dimensions
    if isinstance(a, torch.Tensor):
        return _NUMPY[a.dtype], a.dim()
    return a.dtype, a.ndim


def _compile_body(kernel: Dispatcher, specs: tuple, per_share: int):
    unpack, names, at = [], [], _HEAD
    for i, spec in enumerate(specs):  # each array from its address and shape (_header)
        if spec is None:
            names.append("None")
            continue
        dtype, ndim = spec
        shape = "".join(f"h[{at + 1 + d}], " for d in range(ndim))
        unpack.append(f"    a{i} = carray(_pointer(h[{at}]), ({shape}), np.{dtype.name})")
        names.append(f"a{i}")
        at += 1 + ndim
    share = ", ".join(f"h[p + {j}]" for j in range(per_share))
    fn = kernel.py_func
    body = "\n".join(
        [
            "@cfunc(types.void(types.voidptr), cache=True)",
            "def body(data):",
            f"    h = carray(data, ({_HEAD},), np.int64)",
            "    n = h[1]",
            f"    h = carray(data, ({at} + n * {per_share},), np.int64)",
            *unpack,
            "    while True:",
            "        i = _claim(h.ctypes.data)",  # the counter is the header's first slot
            "        if i >= n:",
            "            break",
            f"        p = {at} + i * {per_share}",
            f"        kernel({', '.join(names)}, {share})",
        ]
    )
    source = _MODULE.format(module=fn.__module__, name=fn.__name__, body=body)
    return _load(source).body


_MODULE = """# made by rlops.scan._team: the shares of one kernel for one set of argument types
import numpy as np
from numba import carray, cfunc, types

from rlops.scan._team import _claim, _pointer
from {module} import {name} as kernel

{body}
"""


def _stamp() -> str:
    """The sizes and times of the kernels' sources: a cached ``cfunc`` holds the kernel's
    machine code, which numba's cache does not check against the kernel's own source."""
    here = os.path.dirname(os.path.abspath(__file__))
    parts = []
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            st = os.stat(os.path.join(here, name))
            parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(parts)


def _directory() -> str | None:
    """A directory for the generated modules (imported from there), outside the package: under
    ``NUMBA_CACHE_DIR`` where it is set, else the user's cache directory, else the temporary
    directory; the first that this user owns and no one else may write to (None: they are
    compiled in memory, in each process)."""
    user = os.getuid() if hasattr(os, "getuid") else None
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    paths = [os.path.join(home, "rlops", "shares")]
    if os.environ.get("NUMBA_CACHE_DIR"):
        paths.insert(0, os.path.join(os.environ["NUMBA_CACHE_DIR"], "rlops-shares"))
    paths.append(os.path.join(tempfile.gettempdir(), f"rlops-shares-{user}"))
    for path in paths:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            st = os.stat(path)
        except OSError:
            continue
        if user is not None and _private(path, st, user):
            return path
    return None


def _private(path: str, st: os.stat_result, owner: int) -> bool:
    """Whether modules may be imported from ``path``: owned by ``owner``, writable by this
    process and by no one else (group and others)."""
    return st.st_uid == owner and os.access(path, os.W_OK) and not st.st_mode & 0o022


def _load(source: str):
    """The module of ``source``, from a file named by its digest (and :func:`_stamp`) so that
    numba caches its ``cfunc`` on disk: written once, atomically (processes may race to write
    the same text), never rewritten (its time keys numba's cache)."""
    digest = hashlib.sha256((_stamp() + source).encode()).hexdigest()[:20]
    name = f"rlops_shares_{digest}"
    directory = _directory()
    if directory is None:
        module = ModuleType(name)
        exec(compile(source, f"<{name}>", "exec"), module.__dict__)
        return module
    path = os.path.join(directory, name + ".py")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run(kernel: Dispatcher, args: tuple, parts: Sequence[tuple]) -> bool:
    """``kernel(*args, *part)`` for every part, on torch's OpenMP team of ``len(parts)``
    threads (the calling thread one of them; the parts must write apart). False, with nothing
    run, where an array is not C-contiguous (the shares rebuild each array from its address
    and shape)."""
    if not all(a is None or a.flags.c_contiguous for a in args):
        return False
    key = (kernel, len(parts[0]), *(None if a is None else (a.dtype, a.ndim) for a in args))
    body = _body(kernel, key, args, len(parts[0]))
    header = _header(args, parts)
    _gomp_parallel()(body.address, header.buffer_info()[0], len(parts), 0)
    return True


def launch(kernel, args: tuple, parts: Sequence[tuple]) -> bool:
    """:func:`run` on C-contiguous CPU tensors (None for None; bfloat16 read as its bits),
    without numpy views and without numba's dispatch: the shares' ``cfunc`` takes their
    addresses and shapes, one part on the calling thread (a ``ctypes`` call, the GIL
    released), more on torch's OpenMP team. Each step of a call costs 3-50 us when the call
    before has flushed the caches: a numpy view each, the dispatch's typing of each array.
    False, with nothing run, where it cannot: not a numba kernel, a dtype the kernels do not
    take, several parts and no OpenMP team. A tensor not C-contiguous: ValueError."""
    made = header(kernel, args, parts)
    if made is None:
        return False
    made.run()
    return True


class Header:
    """A launch made once (:func:`header`): the header's slots (each array's address and
    shape, the shares) and the shares' compiled entry, run again on arrays of the same dtypes
    and shapes at other addresses (:meth:`run`): a kept launch skips the per-tensor reads and
    the lookups (the plain calls' launches, :mod:`rlops.advantages.compiled`)."""

    __slots__ = ("at", "body", "call", "parts", "slots")

    def __init__(self, slots: list, at: list, parts: int, body: int, call) -> None:
        self.slots, self.at, self.parts, self.body, self.call = slots, at, parts, body, call

    def run(self, addresses: Sequence[int] = ()) -> None:
        """Run the shares; ``addresses``, where given, replace the arrays' of :attr:`at` (the
        header's slot of each array given to :func:`header` as one of ``varying``)."""
        slots = self.slots
        if addresses:
            slots = slots.copy()
            for i, address in zip(self.at, addresses, strict=True):
                slots[i] = address
        # (an array.array, not numpy: a numpy array's address costs a ctypes object each call)
        buffer = array.array("q", slots)
        address = buffer.buffer_info()[0]
        if self.parts == 1:
            self.call(address)
        else:
            _gomp_parallel()(self.body, address, self.parts, 0)


def header(kernel, args: tuple, parts: Sequence[tuple], varying: Sequence[int] = ()):
    """The :class:`Header` of :func:`launch` (None where it cannot run: see there), with
    :attr:`Header.at` the slots of the addresses of ``args[i]`` for ``i`` in ``varying`` (those
    not None, in that order)."""
    if not isinstance(kernel, Dispatcher) or (len(parts) > 1 and _gomp_parallel() is None):
        return None
    key: list = [kernel, len(parts[0])]  # the body's, and the header's slots with it
    slots: list = [0, len(parts)]
    at: dict = {}
    for i, a in enumerate(args):
        if a is None:
            key.append(None)
            continue
        dtype = a.dtype
        if dtype not in _NUMPY:
            return None
        if not a.is_contiguous():
            raise ValueError("the compiled kernels take C-contiguous tensors")
        shape = a.shape  # (one call for the dimensions and the shape: each microseconds, cold)
        key += (dtype, len(shape))
        at[i] = len(slots)
        slots.append(a.data_ptr())
        slots += shape
    for part in parts:
        slots += part
    spec = tuple(key)
    call = _calls.get(spec)
    if call is None:
        _body(kernel, spec, args, len(parts[0]))
        call = _calls[spec]
    slots_at = [at[i] for i in varying if i in at]
    return Header(slots, slots_at, len(parts), _bodies[spec].address, call)
