"""Compiled single-pass CPU scan (numba, the ``fast`` extra), eight rows in the lanes of one
vector with float64 carries (:mod:`rlops.scan.tiles`; per-token decays four rows at once);
large inputs split by rows over :mod:`rlops._threads` (:func:`run_rows`, shared with the
estimators' kernels). bfloat16 is read and written as it is (its bits, :func:`bits`) and
computed in float32. numba and numpy are imported on first use only.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

from rlops._threads import split_with_caller
from rlops.scan.decay import is_per_token

__all__ = ["LANES", "as_array", "available", "bits", "output", "run_rows", "scan_compiled"]

LANES = 4
_MIN_ELEMENTS_PER_THREAD = 1 << 17
_PAGE, _MADV_POPULATE_WRITE = 4096, 23
_MIN_POPULATE = 1 << 20  # bytes: smaller blocks come from malloc's heap, mapped already


@functools.cache
def _numba():
    try:
        import numba
    except ImportError:
        return None
    return numba


def available() -> bool:
    """Whether numba can be imported (the ``fast`` extra)."""
    return _numba() is not None


def run_rows(kernel, n_rows: int, n_elements: int, *args, lanes: int = LANES) -> None:
    """Run ``kernel(*args, start, stop)`` on the groups of ``lanes`` rows ``start`` to ``stop``
    (a short last group repeats its last row: the same values are written twice): one call, or
    one per thread when it pays, each on a contiguous range of groups, the calling thread
    running the first."""
    groups = -(-n_rows // lanes)
    threads = max(1, min(torch.get_num_threads(), n_elements // _MIN_ELEMENTS_PER_THREAD, groups))
    per = -(-groups // threads)
    parts = [(g, min(g + per, groups)) for g in range(0, groups, per)]

    def work(part):
        kernel(*args, *part)

    split_with_caller(work, parts)


def bits(t: torch.Tensor):
    """A contiguous CPU tensor as the numpy array the kernels take: bfloat16 as its ``uint16``
    bits (the kernels compute it in float32), any other dtype as it is."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    return t.numpy()


@functools.cache
def _madvise():
    """libc's ``madvise`` on Linux 5.14+ (``MADV_POPULATE_WRITE``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    probe = torch.empty(2 * _PAGE, dtype=torch.uint8)  # a kernel without the advice: EINVAL
    start = -(-probe.data_ptr() // _PAGE) * _PAGE
    return madvise if madvise(start, _PAGE, _MADV_POPULATE_WRITE) == 0 else None


@functools.cache
def _mincore():
    """libc's ``mincore`` on Linux (whether pages are mapped in), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return mincore


def _mapped_in(start: int, end: int) -> bool:
    """Whether the first and the last page of ``[start, end)`` (page-aligned) are mapped in: a
    block malloc reused (no advice needed) rather than one mapped afresh."""
    mincore = _mincore()
    if mincore is None:
        return False
    flags = ctypes.create_string_buffer(1)
    for page in (start, end - _PAGE):
        if mincore(page, _PAGE, flags) != 0 or not flags.raw[0] & 1:
            return False
    return True


def output(like: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(like)`` (contiguous, CPU) with its whole pages mapped in now, by the
    calling thread in one system call: a fresh large block is page-faulted in on first write,
    one trap per 4 KiB page, and the workers of a split call would take those traps in parallel
    (slower than one thread on some hosts, virtual machines above all). On memory already
    mapped (a block malloc reuses: its first and last pages are, ``mincore``) it is skipped: the
    walk of the page table cost 30 us per 4 MiB. Without the advice (not Linux, a kernel
    before 5.14) it does nothing."""
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    nbytes = out.numel() * out.element_size()
    madvise = _madvise() if nbytes >= _MIN_POPULATE else None
    if madvise is not None:
        start = -(-out.data_ptr() // _PAGE) * _PAGE
        end = (out.data_ptr() + nbytes) // _PAGE * _PAGE
        if end > start and not _mapped_in(start, end):
            madvise(start, end - start, _MADV_POPULATE_WRITE)  # a hint: failure changes nothing
    return out


def as_array(t: torch.Tensor | None, dtype: torch.dtype):
    """A kernel's optional ``[N, T]`` input as a contiguous numpy array of ``dtype`` (None stays
    None: the kernel is built without it)."""
    return None if t is None else t.to(dtype).contiguous().numpy()


def scan_compiled(x: torch.Tensor, decay: float | torch.Tensor) -> torch.Tensor:
    """Reverse scan of ``x`` ``[N, T]`` (float32/64, or bfloat16 computed in float32, CPU);
    ``decay`` a float, [N, 1] or [N, T]. Returns ``y`` in ``x``'s dtype.

    Per-row decays are passed in float64 (the carry's dtype), per-token decays in the
    arithmetic dtype (float32 for bfloat16)."""
    from rlops.scan import _numba_kernels as k
    from rlops.scan import tiles

    x = x.contiguous()
    n, t_len = x.shape
    y = output(x)
    if n == 0 or t_len == 0:
        return y
    if is_per_token(decay, t_len):
        arith = torch.float32 if x.dtype == torch.bfloat16 else x.dtype
        a = decay.to(arith).expand(n, t_len).contiguous()
        run_rows(k.scan_tokens, n, x.numel(), bits(x), a.numpy(), bits(y))
    else:
        if isinstance(decay, torch.Tensor):
            w = decay.reshape(-1).expand(n)
        else:
            w = torch.full((n,), float(decay), dtype=torch.float64)
        wide = w.to(torch.float64).contiguous().numpy()
        start = torch.zeros(n, dtype=torch.float32 if x.dtype == torch.bfloat16 else x.dtype)
        args = (None, None, None, None, start.numpy(), None, wide, None, bits(y))
        run_rows(tiles.gae, n, x.numel(), bits(x), *args, lanes=tiles.WIDTH)
        cut = w == 0  # a zero decay is an exact cut: y = x, whatever follows (even NaN)
        if bool(cut.any()):  # a host tensor: no device synchronisation
            y[cut] = x[cut]
    return y
