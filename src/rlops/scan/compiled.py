"""Compiled single-pass CPU scan (numba, the ``fast`` extra), eight rows in the lanes of one
vector with float64 carries (:mod:`rlops.scan.tiles`; per-token decays four rows at once);
large inputs split by rows, or fewer rows than threads in time, over torch's OpenMP threads
(:func:`run_rows`, shared with the estimators' kernels; :mod:`rlops.scan._team`). bfloat16 is
read and written as it is (its bits, :func:`bits`) and computed in float32. numba and numpy
are imported on first use only.
"""

from __future__ import annotations

import functools
import itertools

import torch

from rlops._checks import as_dtype
from rlops._threads import split_with_caller
from rlops.scan.decay import is_per_token

__all__ = [
    "LANES",
    "as_input",
    "available",
    "bits",
    "header",
    "kernels",
    "launch",
    "output",
    "outputs",
    "per_row",
    "run_rows",
    "scan_compiled",
]

LANES = 4
_MIN_ELEMENTS_PER_THREAD = 1 << 17
# Rows split in time from 256K elements a piece: on torch's OpenMP team the split ran 0.70-0.91x
# the one-thread time at 8 x 131072 and 0.78-0.97x at 8 x 65536 (2-core VM); on the Python pool
# (a thread to wake, 0.1-0.2 ms there) 0.88-1.20x at 8 x 131072.
_MIN_ELEMENTS_PER_PIECE = 1 << 18
_MIN_POPULATE = 1 << 20  # bytes: smaller blocks come from malloc's heap, mapped already
#: the time a tile walked for its carries alone takes, against one written, as a row split in
#: time is cut (:func:`pieces`): the returns kernel's (``tiles.gae`` without values: 0.43-0.48
#: measured; swept on two threads at 8 x 131072, 0.45 ran fastest in float32 and within 2% of
#: bfloat16's best, 0.35, both faster than 0.5); the estimators pass their own kernel's
CARRIES_ONLY = 0.45


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


@functools.cache
def _team():
    # rlops.scan._team, imported on first use (it imports numba); kept: an import statement in
    # a function costs microseconds a call when the caches are cold
    from rlops.scan import _team

    return _team


@functools.cache
def kernels():
    """:mod:`rlops.scan.tiles` (the kernels; it imports numba), imported on first use."""
    from rlops.scan import tiles

    return tiles


@functools.cache
def _pages():
    from rlops.scan import _pages

    return _pages


@functools.lru_cache(maxsize=256)
def _shares(
    n_rows: int, n_elements: int, lanes: int, tiles: int | None, threads: int, carries: float
) -> tuple:
    # the shares of :func:`run_rows`: (start, stop) groups, with ``tiles`` (skip, take) after
    # (kept per shape, thread count and kernel: not to be changed)
    groups = -(-n_rows // lanes)
    threads = max(1, min(threads, n_elements // _MIN_ELEMENTS_PER_THREAD))
    whole = () if tiles is None else (0, tiles)
    split = min(threads // groups, n_elements // _MIN_ELEMENTS_PER_PIECE)
    if tiles is not None and split > 1:
        cuts = pieces(tiles, split, carries)
        # the row's start first: the caller's, the piece with the longest walk for its carries
        spans = [(a, b - a) for a, b in itertools.pairwise(cuts)][::-1]
        return tuple((g, g + 1, *span) for span in spans for g in range(groups))
    per = -(-groups // min(threads, groups))
    return tuple((g, min(g + per, groups), *whole) for g in range(0, groups, per))


def run_rows(
    kernel,
    n_rows: int,
    n_elements: int,
    *args,
    lanes: int = LANES,
    tiles: int | None = None,
    carries: float = CARRIES_ONLY,
) -> None:
    """Run ``kernel(*args, start, stop)`` on the groups of ``lanes`` rows ``start`` to ``stop``
    (a short last group repeats its last row: the same values are written twice): one call, or
    one per thread when it pays, each on a contiguous range of groups: a numba kernel's on
    torch's OpenMP threads where torch runs on OpenMP (:mod:`rlops.scan._team`), else over
    :mod:`rlops._threads`, the calling thread running the first.

    With ``tiles`` (the whole tiles of a row, for the kernels of :mod:`rlops.scan.tiles`, which
    take ``skip, take`` after ``start, stop``), a call of fewer groups than threads, of 256K
    elements a piece or more, splits its rows in time instead (:func:`pieces`; each group on
    that many threads): a piece walks the tiles after it for the carries alone (in a fraction
    ``carries`` of a written tile's time), so the rows' bits are those of one thread's pass."""
    threads = torch.get_num_threads()
    _run(kernel, args, _shares(n_rows, n_elements, lanes, tiles, threads, carries))


def _run(kernel, args: tuple, parts: tuple) -> None:
    if len(parts) == 1:
        kernel(*args, *parts[0])
        return
    if available() and not torch.compiler.is_compiling():
        team = _team()
        if team.available(kernel) and team.run(kernel, args, parts):
            return  # on torch's OpenMP threads, none to wake (_team)

    def work(part):
        kernel(*args, *part)

    split_with_caller(work, parts)


def launch(
    kernel,
    n_rows: int,
    *args,
    lanes: int = LANES,
    tiles: int | None = None,
    carries: float = CARRIES_ONLY,
) -> None:
    """:func:`run_rows` on tensors (CPU, C-contiguous, None for None; bfloat16 read as its
    bits; ``n_elements`` the first's), as the estimators call the kernels: through the shares'
    compiled entry (:func:`header`: no numpy views, no numba dispatch), or where it cannot, on
    the tensors' numpy arrays (:func:`bits`). The kernels index rows by
    their length: a tensor that is not C-contiguous is refused (ValueError), not read wrong.
    ``tiles`` and ``carries`` as in :func:`run_rows`."""
    if header(kernel, n_rows, *args, lanes=lanes, tiles=tiles, carries=carries) is not None:
        return  # (made and run; refuses a tensor not C-contiguous)
    parts = _shares(n_rows, args[0].numel(), lanes, tiles, torch.get_num_threads(), carries)
    if not all(a is None or a.is_contiguous() for a in args):
        raise ValueError("the compiled kernels take C-contiguous tensors")
    _run(kernel, tuple(None if a is None else bits(a) for a in args), parts)


def header(
    kernel,
    n_rows: int,
    *args,
    lanes: int = LANES,
    tiles: int | None = None,
    carries: float = CARRIES_ONLY,
    varying: tuple = (),
):
    """:func:`launch`'s launch made to be run again on arrays of the same dtypes and shapes
    (:class:`rlops.scan._team.Header`; ``varying``: the indices of the ``args`` whose addresses
    a run gives), run once here; None, with nothing run, where the shares' compiled entry
    cannot take the call (:func:`launch` then runs it on numpy arrays)."""
    parts = _shares(n_rows, args[0].numel(), lanes, tiles, torch.get_num_threads(), carries)
    if not available() or torch.compiler.is_compiling():
        return None
    made = _team().header(kernel, args, parts, varying)
    if made is not None:
        made.run()
    return made


_MIN_PIECE = 64  # tiles: 1024 tokens


def pieces(tiles: int, count: int, carries: float = CARRIES_ONLY) -> list[int]:
    """Where to cut rows of ``tiles`` whole tiles into at most ``count`` pieces of about equal
    work, in tiles from the row's end (``[0, ..., tiles]``): piece ``j`` walks the ``cuts[j]``
    tiles after it for the carries alone (a fraction ``carries`` of the time of a written
    tile, in (0, 1]), then writes its own, so that pieces nearer the row's start are shorter."""
    if not 0.0 < carries <= 1.0:  # (NaN too)
        raise ValueError(f"carries must be in (0, 1]: a fraction of a written tile, got {carries}")
    count = max(1, min(count, tiles // _MIN_PIECE))
    keep = 1.0 - carries
    # equal work c: cuts[j + 1] = keep * cuts[j] + c, cuts[count] = tiles
    c = tiles * carries / (1.0 - keep**count)
    cuts = [round(c * (1.0 - keep**j) / carries) for j in range(count)]
    return [*cuts, tiles]


def bits(t: torch.Tensor):
    """A contiguous CPU tensor as the numpy array the kernels take: bfloat16 as its ``uint16``
    bits (the kernels compute it in float32), any other dtype as it is."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    return t.numpy()


def outputs(like: torch.Tensor, count: int) -> list:
    """``count`` tensors ``torch.empty_like(like)`` (contiguous, CPU), each with its whole
    pages mapped in now, by the calling thread in one system call: a fresh large block is
    page-faulted in on first write, one trap per 4 KiB page, and the workers of a split call
    would take those traps in parallel (slower than one thread on some hosts, virtual machines
    above all). On memory already mapped (a block malloc reuses: its first and last pages are,
    ``mincore``) it is skipped: the walk of the page table cost 30 us per 4 MiB. The checks and
    the advice for two outputs are one call of compiled code
    (:func:`rlops.scan._pages.populate`). Without the advice (not Linux, a kernel before 5.14)
    it does nothing."""
    contiguous, outs = like.is_contiguous(), []
    for _ in range(count):  # (a loop, and no keyword where it is not needed: a comprehension
        # and the keyword cost 4 us each when the caches are cold)
        if contiguous:
            outs.append(torch.empty_like(like))
        else:
            outs.append(torch.empty_like(like, memory_format=torch.contiguous_format))
    nbytes = like.numel() * like.element_size()
    if nbytes >= _MIN_POPULATE:
        pages = _pages()
        if pages.works():  # a hint: failure changes nothing
            for i in range(0, count, 2):
                second = (outs[i + 1].data_ptr(), nbytes) if i + 1 < count else (0, 0)
                pages.populate(outs[i].data_ptr(), nbytes, *second)
    return outs


def output(like: torch.Tensor) -> torch.Tensor:
    """One of :func:`outputs`."""
    return outputs(like, 1)[0]


def as_input(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A kernel's optional ``[N, T]`` input as a contiguous tensor of ``dtype`` (None stays
    None: the kernel is built without it)."""
    if t is None:
        return None
    t = as_dtype(t, dtype)  # no dispatch where it has the dtype (each tens of us, caches cold)
    return t if t.is_contiguous() else t.contiguous()


@functools.lru_cache(maxsize=64)
def _filled(value: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    # keyed by the float's exact text: 0.0 == -0.0 (and so their hashes), but not their bits
    return torch.full((n,), float.fromhex(value), dtype=dtype)  # torch's rounding


def per_row(value: float | torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-row parameter of a call on ``N`` rows (a float, or a tensor of ``N`` values: ``[N]``
    or ``[N, 1]``) as the kernels' contiguous ``[N]`` tensor of ``dtype``. A float's tensor is
    made once and kept (the kernels only read it): a call's fixed cost is a few small
    operations, each tens of microseconds when the call before has flushed the caches."""
    if isinstance(value, torch.Tensor):  # (no view or copy it does not need: each a dispatch)
        v = value if value.dim() == 1 else value.reshape(-1)
        v = as_dtype(v if v.shape[0] == n else v.expand(n), dtype)
        return v if v.is_contiguous() else v.contiguous()
    return _filled(float(value).hex(), n, dtype)


def scan_compiled(x: torch.Tensor, decay: float | torch.Tensor) -> torch.Tensor:
    """Reverse scan of ``x`` ``[N, T]`` (float32/64, or bfloat16 computed in float32, CPU);
    ``decay`` a float, [N, 1] or [N, T]. Returns ``y`` in ``x``'s dtype.

    Per-row decays are passed in float64 (the carry's dtype), per-token decays in the
    arithmetic dtype (float32 for bfloat16)."""
    from rlops.scan import _numba_kernels as k

    tiles = kernels()

    x = x.contiguous()
    n, t_len = x.shape
    y = output(x)
    if n == 0 or t_len == 0:
        return y
    if is_per_token(decay, t_len):
        arith = torch.float32 if x.dtype == torch.bfloat16 else x.dtype
        a = decay.to(arith).expand(n, t_len).contiguous()
        launch(k.scan_tokens, n, x, a, y)
    else:
        wide = per_row(decay, n, torch.float64)
        start = per_row(0.0, n, torch.float32 if x.dtype == torch.bfloat16 else x.dtype)
        args = (None, None, None, None, start, None, wide, None, y)
        launch(tiles.gae, n, x, *args, lanes=tiles.WIDTH, tiles=t_len // tiles.TOKENS)
        # a zero decay is an exact cut: y = x, whatever follows (even NaN)
        if isinstance(decay, torch.Tensor):
            cut = decay.reshape(-1).expand(n) == 0
            if bool(cut.any()):  # a host tensor: no device synchronisation
                y[cut] = x[cut]
        elif decay == 0:
            y.copy_(x)
    return y
