"""The compiled kernels' plumbing (``rlops.scan.compiled``): the outputs they write (mapped in
by the calling thread, contiguous, whatever the input's layout) and the split of the groups of
four rows over threads (every group once, in contiguous ranges, one call per thread)."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from rlops.scan import compiled


@pytest.mark.parametrize("shape", [(0, 5), (3, 7), (8, 1 << 16)])  # empty, small, 2 MiB
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_an_output_is_a_new_contiguous_tensor_like_the_input(shape, dtype):
    like = torch.randn(shape[::-1]).to(dtype).t()  # not contiguous
    out = compiled.output(like)
    assert out.shape == like.shape and out.dtype == dtype and out.is_contiguous()
    assert out.data_ptr() != like.data_ptr() or out.numel() == 0
    out.fill_(1.0)  # every page writable
    assert bool((out == 1).all())


@pytest.mark.parametrize("rows", [1, 4, 5, 9, 257])
@pytest.mark.parametrize("threads", [1, 2])
def test_groups_are_split_in_contiguous_ranges_one_call_per_thread(rows, threads):
    calls, lock = [], threading.Lock()

    def kernel(tag, start, stop):
        with lock:
            calls.append((tag, start, stop))

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compiled.run_rows(kernel, rows, rows << 18, "args")
    finally:
        torch.set_num_threads(before)
    groups = -(-rows // compiled.LANES)
    ranges = sorted((start, stop) for _, start, stop in calls)
    assert all(tag == "args" for tag, _, _ in calls)
    assert len(ranges) == min(threads, groups)
    assert ranges[0][0] == 0 and ranges[-1][1] == groups
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # no gap, no overlap


def test_a_small_call_stays_on_the_callers_thread():
    seen = []
    compiled.run_rows(lambda start, stop: seen.append(threading.current_thread()), 64, 64 * 100)
    assert seen == [threading.current_thread()]


@pytest.mark.parametrize("lanes", [4, 8])
def test_a_split_call_runs_its_first_share_on_the_callers_thread(lanes):
    """With two threads the caller takes the first range of groups (no worker to wake for it)
    and a pool worker the other; every group is run once."""
    calls, lock = [], threading.Lock()

    def kernel(start, stop):
        with lock:
            calls.append((threading.current_thread(), start, stop))

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        compiled.run_rows(kernel, 64, 64 << 18, lanes=lanes)
    finally:
        torch.set_num_threads(before)
    groups = 64 // lanes
    by_range = {(start, stop): thread for thread, start, stop in calls}
    assert sorted(by_range) == [(0, groups // 2), (groups // 2, groups)]
    assert by_range[0, groups // 2] is threading.current_thread()
    assert by_range[groups // 2, groups] is not threading.current_thread()


def test_a_split_call_raises_after_every_share_has_run():
    from rlops._threads import split_with_caller

    ran = []

    def body(item):
        ran.append(item)
        if item == 1:
            raise ValueError("item 1")

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(ValueError, match="item 1"):
            split_with_caller(body, [0, 1])
        with pytest.raises(ValueError, match="item 1"):
            split_with_caller(body, [1, 0])
    finally:
        torch.set_num_threads(before)
    assert sorted(ran) == [0, 0, 1, 1]


def test_populate_maps_fresh_pages_in_and_skips_written_ones():
    """``output`` maps a fresh block in at once and skips the advice on a reused one: an
    anonymous mapping never written (or written on its first page only) is advised, and
    afterwards every page is mapped in; one written on its first and last pages is not."""
    import ctypes
    import mmap

    from rlops.scan._pages import PAGE, populate, works

    if not works():
        pytest.skip("no MADV_POPULATE_WRITE here")

    size = 16 * PAGE
    for written in ((), (0,), (0, size - 1)):
        block, second = mmap.mmap(-1, size), mmap.mmap(-1, size)
        try:
            for i in written:
                block[i] = 1
            start = ctypes.addressof(ctypes.c_char.from_buffer(block))
            other = ctypes.addressof(ctypes.c_char.from_buffer(second))
            assert populate(start, size, 0, 0) == (0 if len(written) == 2 else 1)
            assert populate(start, size, 0, 0) == 0  # mapped in now
            assert populate(start + 1, PAGE, 0, 0) == 0  # no whole page inside: nothing to do
            assert populate(other, size, 0, 0) == 1  # a fresh block: advised
        finally:
            block.close()
            second.close()
    block, second = mmap.mmap(-1, size), mmap.mmap(-1, size)  # two fresh blocks in one call
    try:
        start = ctypes.addressof(ctypes.c_char.from_buffer(block))
        other = ctypes.addressof(ctypes.c_char.from_buffer(second))
        assert populate(start, size, other, size) == 1
        assert populate(start, size, 0, 0) == 0 and populate(other, size, 0, 0) == 0
    finally:
        block.close()
        second.close()


def test_output_advises_large_blocks_only(monkeypatch):
    import rlops.scan._pages as pages

    if not pages.works():
        pytest.skip("no MADV_POPULATE_WRITE here")

    calls = []

    def populate(address, nbytes, address2, nbytes2):
        calls.append((nbytes, nbytes2, address2 != 0))
        return 0

    monkeypatch.setattr(pages, "populate", populate)
    compiled.output(torch.zeros(1 << 20))  # 4 MiB
    assert calls == [(4 << 20, 0, False)]
    compiled.output(torch.zeros(1 << 10))  # 4 KiB: from malloc's heap, mapped already
    assert calls == [(4 << 20, 0, False)]
    calls.clear()
    compiled.outputs(torch.zeros(1 << 20), 3)  # two in one call, then the third
    assert calls == [(4 << 20, 4 << 20, True), (4 << 20, 0, False)]


@pytest.mark.parametrize("tiles", [64, 127, 128, 1000, 8192])
@pytest.mark.parametrize("count", [1, 2, 3, 4])
@pytest.mark.parametrize("carries", [0.4, compiled.CARRIES_ONLY, 0.6])
def test_pieces_cover_the_row_with_about_equal_work(tiles, count, carries):
    """Cuts from 0 to the row's tiles, increasing, no more pieces than 64 tiles each on
    average (fewer where the row is short); a piece's work (its own tiles, plus the tiles
    after it walked for the carries alone at a fraction ``carries`` of the time) the same to
    a tile."""
    cuts = compiled.pieces(tiles, count, carries)
    assert cuts[0] == 0 and cuts[-1] == tiles
    assert len(cuts) - 1 == max(1, min(count, tiles // 64))
    sizes = [b - a for a, b in itertools.pairwise(cuts)]
    assert all(s > 0 for s in sizes)
    work = [carries * a + (b - a) for a, b in itertools.pairwise(cuts)]
    assert max(work) - min(work) <= 1.0 + carries


@pytest.mark.parametrize("carries", [0.0, -0.5, 1.5, float("nan"), float("inf")])
def test_pieces_refuse_a_fraction_outside_0_to_1(carries):
    with pytest.raises(ValueError, match="carries must be in"):
        compiled.pieces(8192, 2, carries)


def test_one_group_on_two_threads_is_split_in_time_the_caller_taking_the_rows_start():
    calls, lock = [], threading.Lock()

    def kernel(start, stop, skip, take):
        with lock:
            calls.append((threading.current_thread(), start, stop, skip, take))

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        compiled.run_rows(kernel, 8, 8 << 20, lanes=8, tiles=1 << 16)  # 8 rows of 1M tokens
        compiled.run_rows(kernel, 8, 8 << 15, lanes=8, tiles=1 << 11)  # 32K: not worth it
    finally:
        torch.set_num_threads(before)
    split, whole = calls[:2], calls[2:]
    cuts = compiled.pieces(1 << 16, 2)
    by_piece = {(skip, take): thread for thread, _, _, skip, take in split}
    assert sorted(by_piece) == [(0, cuts[1]), (cuts[1], (1 << 16) - cuts[1])]
    assert by_piece[cuts[1], (1 << 16) - cuts[1]] is threading.current_thread()
    assert all((start, stop) == (0, 1) for _, start, stop, _, _ in split)
    assert [c[1:] for c in whole] == [(0, 1, 0, 1 << 11)]


def _numba_call(rows: int, t: int):
    """A compiled GAE kernel's arguments on ``[rows, t]`` float32 inputs, its outputs zeroed."""
    import numpy as np

    r, v = torch.randn(rows, t), torch.randn(rows, t)
    adv, ret = torch.zeros(rows, t), torch.zeros(rows, t)
    g, gl = np.ones(rows, np.float32), np.full(rows, 0.95)
    args = (r.numpy(), v.numpy(), None, None, None, np.zeros(rows, np.float32), g, gl)
    return (*args, adv.numpy(), ret.numpy()), (adv, ret)


@pytest.mark.parametrize("rows", [8, 64])
def test_numba_kernels_split_on_torchs_openmp_threads_give_one_threads_bits(rows, monkeypatch):
    """Where torch runs on OpenMP, a numba kernel's shares run on its team (rlops.scan._team);
    without it (the runtime's entry point not found) on the Python pool; the bits are one
    thread's either way."""
    from rlops.scan import _team, tiles

    if not _team.available(tiles.gae):
        pytest.skip("torch does not run on an OpenMP runtime here")
    args, (adv, ret) = _numba_call(rows, 1 << 15)
    tiles_n = (1 << 15) // tiles.TOKENS
    compiled.run_rows(tiles.gae, rows, 1 << 30, *args, lanes=8, tiles=tiles_n)  # 1 thread
    want = adv.clone(), ret.clone()
    runs = []
    real_run = _team.run
    monkeypatch.setattr(_team, "run", lambda *a: runs.append(len(a[2])) or real_run(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for fallback in (False, True):
            if fallback:
                monkeypatch.setattr(_team, "_gomp_parallel", lambda: None)
            adv.zero_(), ret.zero_()
            compiled.run_rows(tiles.gae, rows, 1 << 30, *args, lanes=8, tiles=tiles_n)
            assert torch.equal(adv, want[0]) and torch.equal(ret, want[1]), fallback
    finally:
        torch.set_num_threads(before)
    assert runs == [2]  # the team once; then the pool


def test_the_team_refuses_arrays_not_c_contiguous():
    from rlops.scan import _team, tiles

    args, _ = _numba_call(8, 64)
    args = (args[0].T.copy().T, *args[1:])  # the same values, Fortran order
    assert not _team.run(tiles.gae, args, [(0, 1, 0, 2), (0, 1, 2, 2)])


def test_a_call_from_another_python_thread_splits_on_its_own_team():
    """A call made on a thread of the caller's own (the master of its own OpenMP team there)
    gives the bits of one thread."""
    import rlops

    r, v = torch.randn(8, 1 << 16), torch.randn(8, 1 << 16)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = rlops.gae(r, v, gamma=0.99, lam=0.95, method="compiled")
    finally:
        torch.set_num_threads(before)
    got: list = []

    def body():
        torch.set_num_threads(2)
        got.extend(rlops.gae(r, v, gamma=0.99, lam=0.95, method="compiled"))

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


_SHARES = """
import sys, torch
sys.path[:0] = {path!r}
import rlops
from rlops.scan import _team
_team._directory = lambda: {directory!r}
torch.set_num_threads(2)
r = torch.randn(8, 1 << 16)
rlops.gae(r, r.flip(-1), gamma=0.99, lam=0.95, method="compiled")
print(len(_team._bodies), sum(body.cache_hits for body in _team._bodies.values()))
"""


def test_the_shares_are_compiled_once_and_cached_on_disk(tmp_path):
    """The cfunc running a kernel's shares is made in a module file of its own: a second
    process loads it from numba's cache instead of compiling it."""
    import os
    import subprocess
    import sys

    from rlops.scan import _team, tiles

    if not _team.available(tiles.gae):
        pytest.skip("torch does not run on an OpenMP runtime here")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = _SHARES.format(path=[os.path.join(root, "src")], directory=str(tmp_path / "shares"))
    (tmp_path / "shares").mkdir(mode=0o700)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    runs = [
        subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
        )
        for _ in range(2)
    ]
    assert all(run.returncode == 0 for run in runs), runs[-1].stderr[-2000:]
    assert [run.stdout.split() for run in runs] == [["1", "0"], ["1", "1"]]
    assert len(list((tmp_path / "shares").glob("rlops_shares_*.py"))) == 1


def test_shares_are_imported_only_from_a_private_directory(tmp_path):
    import os

    from rlops.scan import _team

    path = tmp_path / "d"
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)
    me = os.getuid()
    assert _team._private(str(path), os.stat(path), me)
    assert not _team._private(str(path), os.stat(path), me + 1)  # someone else's
    os.chmod(path, 0o777)
    assert not _team._private(str(path), os.stat(path), me)  # others may write to it
    assert "tiles.py:" in _team._stamp()  # a kernel's source changing makes new modules


def test_per_row_keeps_the_sign_of_zero_and_torchs_rounding():
    """A float's tensor is kept per value: -0.0 (``-kl_coef`` at ``kl_coef = 0``) is not the
    kept tensor of 0.0, and each rounds to the dtype as ``torch.full`` does."""
    import numpy as np

    for dtype in (torch.float32, torch.float64):
        plus, minus = compiled.per_row(0.0, 3, dtype), compiled.per_row(-0.0, 3, dtype)
        assert not plus.signbit().any() and minus.signbit().all()
    third = compiled.per_row(1 / 3, 2, torch.float32)
    assert third.dtype == torch.float32 and (third.numpy() == np.float32(1 / 3)).all()
    gamma = torch.tensor([[0.5], [0.25]], dtype=torch.float64)
    assert compiled.per_row(gamma, 2, torch.float32).tolist() == [0.5, 0.25]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_tensors_launched_through_the_shares_entry_give_the_arrays_bits(dtype, threads):
    """``launch`` hands tensors' addresses to the shares' compiled entry (no numpy views, no
    numba dispatch): one part on the calling thread, or the parts on the OpenMP team; the bits
    are those of the kernel called on the tensors' numpy arrays."""
    from rlops.scan import _team, tiles

    if threads > 1 and not _team.available(tiles.gae):
        pytest.skip("torch does not run on an OpenMP runtime here")
    rows, t = 8, 1 << 16
    r, v = torch.randn(rows, t).to(dtype), torch.randn(rows, t).to(dtype)
    wide = torch.float32
    params = (
        compiled.per_row(0.5, rows, wide),
        compiled.per_row(0.99, rows, wide),
        compiled.per_row(0.99 * 0.95, rows, torch.float64),
    )
    want = torch.empty_like(r), torch.empty_like(r)
    arrays = [compiled.bits(x) for x in (r, v)]
    tiles_n = t // tiles.TOKENS
    tiles.gae(*arrays, None, None, None, *(p.numpy() for p in params),
              *(compiled.bits(x) for x in want), 0, 1, 0, tiles_n)  # fmt: skip
    got = torch.zeros_like(r), torch.zeros_like(r)
    args = (r, v, None, None, None, *params, *got)
    parts = [(0, 1, 0, tiles_n)]
    if threads > 1:
        cut = compiled.pieces(tiles_n, 2)[1]
        parts = [(0, 1, cut, tiles_n - cut), (0, 1, 0, cut)]
    assert _team.launch(tiles.gae, args, parts)
    assert all(torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
               for a, b in zip(got, want, strict=True))  # fmt: skip


def test_launch_refuses_what_the_entry_cannot_take():
    """A dtype the kernels do not take is left to the numpy path (nothing run); a tensor that
    is not C-contiguous is refused: the kernels index rows by their length."""
    from rlops.scan import _team, tiles

    x = torch.zeros(8, 32, dtype=torch.int32)
    assert not _team.launch(tiles.gae, (x, None), [(0, 1, 0, 2)])
    assert not _team.launch(lambda *a: None, (), [(0, 1)])  # not a numba kernel
    with pytest.raises(ValueError, match="C-contiguous"):
        compiled.launch(tiles.gae, 8, torch.zeros(32, 8).t(), lanes=8, tiles=2)
