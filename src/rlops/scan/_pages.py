"""A fresh output's pages mapped in by one system call, from compiled code (numba; Linux):
:func:`populate`, used by :func:`rlops.scan.compiled.output`.

The same two checks and one advice written from Python through ``ctypes`` cost about 30 us when
the call before has flushed the caches (each foreign call goes through libffi); here they are
one call of a compiled function. ``mincore``, ``madvise`` and the advice's number are Linux's:
:func:`works` asks once whether the advice works here.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from rlops.scan._cache import njit

PAGE = 4096
_MADV_POPULATE_WRITE = 23
_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)


@intrinsic
def _page_mapped(typingctx, address):
    """1 if the page at ``address`` (page-aligned) is mapped in (``mincore``), else 0."""
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(_I32, [_I8.as_pointer(), _I64, _I8.as_pointer()])
        mincore = cgutils.get_or_insert_function(builder.module, fnty, "mincore")
        flags = cgutils.alloca_once_value(builder, ir.Constant(_I8, 0))
        page = builder.inttoptr(args[0], _I8.as_pointer())
        rc = builder.call(mincore, [page, ir.Constant(_I64, PAGE), flags])
        resident = builder.and_(builder.load(flags), ir.Constant(_I8, 1))
        ok = builder.and_(
            builder.icmp_signed("==", rc, ir.Constant(_I32, 0)),
            builder.icmp_unsigned("!=", resident, ir.Constant(_I8, 0)),
        )
        return builder.zext(ok, _I64)

    return sig, codegen


@intrinsic
def _advise_populate(typingctx, address, length):
    """``madvise(address, length, MADV_POPULATE_WRITE)``'s return code."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(_I32, [_I8.as_pointer(), _I64, _I32])
        madvise = cgutils.get_or_insert_function(builder.module, fnty, "madvise")
        start = builder.inttoptr(args[0], _I8.as_pointer())
        rc = builder.call(madvise, [start, args[1], ir.Constant(_I32, _MADV_POPULATE_WRITE)])
        return builder.sext(rc, _I64)

    return sig, codegen


@functools.cache
def works() -> bool:
    """Whether ``madvise(MADV_POPULATE_WRITE)`` works here (Linux 5.14+): asked once, through
    ``ctypes``, on a small block (a kernel without the advice answers EINVAL)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    probe = torch.empty(2 * PAGE, dtype=torch.uint8)
    start = -(-probe.data_ptr() // PAGE) * PAGE
    return madvise(start, PAGE, _MADV_POPULATE_WRITE) == 0


@njit(nogil=True)
def _populate_one(address, nbytes):
    start = (address + PAGE - 1) // PAGE * PAGE
    end = (address + nbytes) // PAGE * PAGE
    if end <= start:
        return 0
    if _page_mapped(start) and _page_mapped(end - PAGE):
        return 0
    return 1 if _advise_populate(start, end - start) == 0 else -1


@njit(nogil=True)
def populate(address, nbytes, address2, nbytes2):
    """Map in the whole pages of ``[address, address + nbytes)`` now, in one system call,
    unless its first and last pages are mapped in already (a block malloc reused, not one
    mapped afresh); then those of the second block (``nbytes2 = 0``: none), so that a call's
    two outputs take one call of compiled code. Returns 1 if it advised, 0 if it skipped, -1
    if the advice failed (a hint: nothing changes), for the first block."""
    done = _populate_one(address, nbytes)
    if nbytes2 > 0:
        _populate_one(address2, nbytes2)
    return done
