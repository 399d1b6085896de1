"""bfloat16 in the compiled CPU kernels: read and written as it is (its bits), computed in
float32, so a bfloat16 call gives the float32 call's result rounded once, bit for bit, with no
float32 copy of an input or an output.

* The kernels' element helpers (``scan.exact_arith``): ``load`` is torch's bfloat16 to float32
  on every one of the 65,536 bit patterns; ``store`` rounds float32 to bfloat16 as torch does
  (to nearest even; NaN stays NaN) on random bit patterns, ties and subnormals.
* ``discounted_cumsum``, ``discounted_returns`` and ``gae`` (masks, dones, bootstraps) in
  bfloat16: the float32 compiled result rounded to bfloat16, at odd sizes, with NaN and inf.
* The inputs reach the kernels in bfloat16; rows split over threads give the same bits; a
  kernel that fails to compile falls back to the float32 chunked scan.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from tests.tolerances import needs_numba

import rlops
from rlops import _backends
from rlops.advantages import compiled as fused
from rlops.advantages.returns import RETURNS
from rlops.scan import SCAN, Row

pytestmark = needs_numba
BF16 = torch.bfloat16
SIZES = [(1, 1), (3, 127), (4, 128), (9, 129), (5, 1000)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN equal to any NaN (torch's own bfloat16 NaN differs by path)."""
    return (
        a.dtype == b.dtype
        and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    )


def _helpers():
    import numba

    from rlops.scan.exact_arith import load, store

    @numba.njit
    def widen(x, y):
        for i in range(x.shape[0]):
            y[i] = load(x, i)

    @numba.njit
    def narrow(x, y):
        for i in range(x.shape[0]):
            store(y, i, x[i])

    return widen, narrow


def test_load_is_torchs_bfloat16_to_float32_on_every_bit_pattern():
    widen, _ = _helpers()
    every = torch.arange(65536, dtype=torch.int32).to(torch.uint16).view(BF16)
    got = torch.empty(65536, dtype=torch.float32)
    widen(every.view(torch.uint16).numpy(), got.numpy())
    assert torch.equal(got.view(torch.int32), every.float().view(torch.int32))  # NaNs too


def test_store_rounds_float32_to_bfloat16_as_torch_does():
    _, narrow = _helpers()
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=g, dtype=torch.int64)
    high = torch.randint(0, 65536, (4096,), generator=g, dtype=torch.int64) << 16
    ties = high | 0x8000  # halfway: to the even neighbour
    x = torch.cat([bits, ties, high | 0x7FFF, high | 0x8001, torch.arange(70000)])
    x = x.to(torch.int32).view(torch.float32)  # random patterns, subnormals, inf, NaN
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4e38, -3.4e38])])
    got = torch.empty(x.shape, dtype=BF16)
    narrow(x.numpy(), got.view(torch.uint16).numpy())
    assert _same(got, x.to(BF16))


@pytest.mark.parametrize(("b", "t"), SIZES)
@pytest.mark.parametrize("decay", ["float", "row", "token", "zero row", "token cuts"])
def test_discounted_cumsum_is_the_float32_kernel_rounded(b, t, decay):
    g = torch.Generator().manual_seed(b * t)
    x = torch.randn(b, t, generator=g).to(BF16)
    a: float | torch.Tensor = 0.97
    if decay == "row":
        a = torch.rand(b, 1, generator=g)
    elif decay == "zero row":
        a = torch.rand(b, 1, generator=g)
        a[0] = 0.0
    elif decay.startswith("token"):
        a = torch.rand(b, t, generator=g)
        if decay == "token cuts":
            a[a < 0.1] = 0.0
            x[0, t // 2] = float("nan")  # cut off from what lies before a zero decay
    got = rlops.discounted_cumsum(x, a, method="compiled")
    want = rlops.discounted_cumsum(x.float(), a, method="compiled").to(BF16)
    assert _same(got, want)


def _inputs(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    r, v = torch.randn(b, t, generator=g).to(BF16), torch.randn(b, t, generator=g).to(BF16)
    mask = torch.rand(b, t, generator=g) < 0.8
    dones = torch.rand(b, t, generator=g) < 0.02
    truncated = dones & (torch.rand(b, t, generator=g) < 0.5)
    boot = torch.randn(b, t, generator=g)
    return r, v, mask, dones, truncated, boot


@pytest.mark.parametrize(("b", "t"), SIZES)
@pytest.mark.parametrize("kind", ["plain", "mask", "dones", "bootstrap", "truncated", "per row"])
def test_gae_and_returns_are_the_float32_kernels_rounded(b, t, kind):
    r, v, mask, dones, truncated, boot = _inputs(b, t, seed=b + t)
    kw: dict = {}
    gamma: float | torch.Tensor = 0.99
    if kind == "mask":
        kw = {"mask": mask}
    elif kind == "dones":
        kw = {"mask": mask, "dones": dones}
    elif kind == "bootstrap":
        kw = {"mask": mask, "bootstrap": boot[:, 0]}
    elif kind == "truncated":
        kw = {"mask": mask, "dones": dones, "bootstrap": boot, "truncated": truncated}
    else:
        gamma = torch.rand(b, dtype=torch.float64) * 0.5 + 0.5
    adv, ret = rlops.gae(r, v, gamma=gamma, lam=0.95, method="compiled", **kw)
    adv32, ret32 = rlops.gae(r.float(), v.float(), gamma=gamma, lam=0.95, method="compiled", **kw)
    assert _same(adv, adv32.to(BF16)) and _same(ret, ret32.to(BF16))
    got = rlops.discounted_returns(r, gamma=gamma, method="compiled", **kw)
    want = rlops.discounted_returns(r.float(), gamma=gamma, method="compiled", **kw)
    assert _same(got, want.to(BF16))


def test_nan_and_inf_reach_what_they_reach():
    r, v, mask, *_ = _inputs(4, 64, seed=7)
    r[0, 10], v[1, 20], r[2, 30] = float("nan"), float("inf"), -float("inf")
    r[3, 40] = float("nan")
    mask[3, 40] = False  # a mask-0 token's reward is ignored, NaN or not
    adv, ret = rlops.gae(r, v, gamma=1.0, lam=0.9, mask=mask, method="compiled")
    adv32, ret32 = rlops.gae(r.float(), v.float(), gamma=1.0, lam=0.9, mask=mask)
    assert _same(adv, adv32.to(BF16)) and _same(ret, ret32.to(BF16))
    assert adv[0, :11][mask[0, :11]].isnan().all() and not adv[0, 11:].isnan().any()
    assert not adv[3].isnan().any()


def test_the_kernels_read_bfloat16_as_it_is(monkeypatch):
    """Every launch of the compiled kernels (the general path's, the plain calls' kept ones,
    the scan's) is made on the bfloat16 tensors themselves; mixed dtypes are promoted first."""
    from rlops.scan import _team

    seen = []
    real = _team.header

    def spy(kernel, args, parts, varying=()):
        seen.append(tuple(None if a is None else a.dtype for a in args[:2]))
        return real(kernel, args, parts, varying)

    monkeypatch.setattr(_team, "header", spy)
    monkeypatch.setattr(RETURNS, "rows", RETURNS.rows)  # (no plan kept yet, whatever ran before)
    monkeypatch.setattr(fused, "_KEPT", {})  # (nor a launch)
    r, v, mask, *_ = _inputs(3, 50, seed=1)
    for _ in range(3):  # the general path, the plain call's launch made, then run as kept
        adv, ret = rlops.gae(r, v, gamma=0.99, lam=0.95)
        assert adv.dtype == ret.dtype == BF16
    assert rlops.discounted_returns(r, gamma=0.99, mask=mask).dtype == BF16
    assert rlops.discounted_cumsum(r, 0.9).dtype == BF16
    assert seen == [(BF16, BF16)] * 2 + [(BF16, None)] * 2
    seen.clear()  # a masked GAE too
    assert rlops.gae(r, v, gamma=0.99, lam=0.95, mask=mask)[0].dtype == BF16
    assert seen == [(BF16, BF16)]
    seen.clear()  # mixed dtypes are promoted first, as before
    rlops.gae(r, v.float(), gamma=0.99, lam=0.95)
    assert seen == [(torch.float32, torch.float32)]


@pytest.mark.parametrize("fn", ["gae", "cumsum"])
def test_rows_split_over_threads_give_the_same_bits(fn):
    r, v, mask, *_ = _inputs(9, 1 << 15, seed=3)  # 3 groups of rows, split over 2 threads

    def run():
        if fn == "gae":
            return torch.cat(rlops.gae(r, v, gamma=0.99, lam=0.95, mask=mask, method="compiled"))
        return rlops.discounted_cumsum(r, 0.97, method="compiled")

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.view(torch.int16), two.view(torch.int16))


@pytest.fixture
def clean_failures(monkeypatch):
    monkeypatch.setattr(_backends, "_failed", {})


def test_a_kernel_that_fails_to_compile_falls_back_to_float32_chunked(clean_failures, monkeypatch):
    from numba.core.errors import TypingError

    def broken(method, *args):
        raise TypingError("cannot compile here")

    for table in (SCAN, RETURNS):
        rows = [
            Row(r.backends, broken) if r.backends[0].name == "compiled" else r for r in table.rows
        ]
        monkeypatch.setattr(table, "rows", rows)
    r, v, mask, *_ = _inputs(3, 100, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        adv, ret = rlops.gae(r, v, gamma=0.99, lam=0.95, mask=mask)
        y = rlops.discounted_cumsum(r, 0.9, method="compiled")
    adv32, ret32 = rlops.gae(
        r.float(), v.float(), gamma=0.99, lam=0.95, mask=mask, method="chunked"
    )
    assert _same(adv, adv32.to(BF16)) and _same(ret, ret32.to(BF16))
    assert _same(y, rlops.discounted_cumsum(r.float(), 0.9, method="chunked").to(BF16))


def _target_has_native_bf16() -> bool:
    from numba.core.registry import cpu_target

    from rlops.scan import tiles

    return tiles.native_bf16(cpu_target.target_context)


def _special_tiles(rows: int, t: int):
    """bfloat16 GAE inputs whose outputs hold, tile by tile: subnormals (the rows' last five
    tiles, and one row's tile among normal rows), a NaN (one row, reaching back to its start;
    an inf in another), and ordinary values, many of them float32 sums halfway between two
    bfloat16 values."""
    g = torch.Generator().manual_seed(rows * t)
    r, v = torch.randn(rows, t, generator=g), torch.randn(rows, t, generator=g)
    r[:, -16 * 5 :] *= 2.0**-130  # every row: subnormal sums, no large carry reaching them
    v[:, -16 * 5 :] *= 2.0**-130
    r[1, 5 + 16 * 20 : 5 + 16 * 21] *= 2.0**-132  # one row only
    v[1, 5 + 16 * 20 : 5 + 16 * 21] *= 2.0**-132
    r[min(3, rows - 1), 16 * 30 + 7] = float("nan")
    v[0, 16 * 25 + 2] = float("inf")
    return r.to(BF16), v.to(BF16)


def _tile_gae(native: bool, r, v, mask, gl: float, monkeypatch) -> list:
    """The bfloat16 GAE kernel built with (or without) the native rounding, on ``r``, ``v``."""
    import numba
    import numpy as np

    from rlops.scan import tiles

    with monkeypatch.context() as patch:
        patch.setattr(tiles, "native_bf16", lambda context: native)
        kernel = numba.njit(tiles.gae.py_func)  # built here, with the path chosen above
        rows, t = r.shape
        outs = [torch.empty(rows, t, dtype=BF16) for _ in range(2)]
        args = (r.view(torch.uint16).numpy(), v.view(torch.uint16).numpy(), mask, None, None)
        params = (np.zeros(rows, np.float32), np.ones(rows, np.float32), np.full(rows, gl))
        bits = [o.view(torch.uint16).numpy() for o in outs]
        kernel(*args, *params, *bits, 0, -(-rows // tiles.WIDTH), 0, t // tiles.TOKENS)
    return outs


@pytest.mark.parametrize("rows", [8, 11])
def test_tile_stores_round_as_torch_with_subnormals_and_nan(rows, monkeypatch):
    """A bfloat16 tile is stored rounded to nearest even as torch rounds float32: by
    ``vcvtne2ps2bf16`` where the target has AVX-512 BF16 and the tile holds no NaN and no
    subnormal (the instruction flushes subnormals and keeps a NaN's bits), else the integer
    way. The integer path gives the float32 kernel's values rounded by torch; the native one
    its very bits, NaNs included."""
    import numpy as np

    from rlops.scan import tiles

    t = 16 * 40 + 5
    r, v = _special_tiles(rows, t)
    mask = torch.rand(rows, t, generator=torch.Generator().manual_seed(1)) < 0.9
    zero, one, groups = np.zeros(rows, np.float32), np.ones(rows, np.float32), -(-rows // 8)
    for m in (None, mask.numpy()):
        for gl in (0.0, 0.5):  # 0: each output is its token's residual, ties kept
            exact = _tile_gae(False, r, v, m, gl, monkeypatch)
            wide = [torch.empty(rows, t) for _ in range(2)]
            args = (r.float().numpy(), v.float().numpy(), m, None, None, zero, one)
            tiles.gae(*args, np.full(rows, gl), *(w.numpy() for w in wide), 0, groups, 0, t // 16)
            for got, want in zip(exact, wide, strict=True):
                assert _same(got, want.to(BF16)), (m is not None, gl)
            assert exact[0].isnan().any() and (exact[0].view(torch.int16) & 0x7F80 == 0).any()
            if _target_has_native_bf16():
                native = _tile_gae(True, r, v, m, gl, monkeypatch)
                for got, want in zip(native, exact, strict=True):
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_the_native_rounding_is_built_where_the_target_has_it():
    import numba
    import numpy as np

    from rlops.scan import tiles

    kernel = numba.njit(tiles.gae.py_func)  # built here: numba's cache keeps no assembly
    x = torch.zeros(8, 64, dtype=BF16).view(torch.uint16).numpy()
    zero, one = np.zeros(8, np.float32), np.ones(8, np.float32)
    kernel(x, None, None, None, None, zero, one, np.ones(8), None, x.copy(), 0, 1, 0, 4)
    asm = kernel.inspect_asm(kernel.signatures[0])
    assert ("vcvtne2ps2bf16" in asm) == _target_has_native_bf16()


def _target_has_permutes() -> bool:
    from numba.core.registry import cpu_target

    from rlops.scan import tiles

    return tiles.permutes(cpu_target.target_context)


@contextlib.contextmanager
def _built(*kernels, **paths):
    """``kernels`` (numba dispatchers of :mod:`rlops.scan.tiles`) built afresh, to be called
    inside the block, with the target tests of ``tiles`` patched (``permutes=False``: the
    half-row loads and the interleaves; ``native_bf16=False``: the integer rounding)."""
    import numba

    from rlops.scan import tiles

    with pytest.MonkeyPatch.context() as patch:
        for name, on in paths.items():
            patch.setattr(tiles, name, lambda context, on=on: on)
        yield [numba.njit(k.py_func) for k in kernels]  # typed and built on their first call


@pytest.mark.skipif(not _target_has_permutes(), reason="the target has no AVX-512 BW")
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("rows, t", [(8, 16 * 40 + 5), (11, 16 * 70), (3, 16 * 66 + 9)])
def test_whole_row_tiles_give_the_interleaved_tiles_bits(native, rows, t):
    """Where the target has AVX-512 BW, bfloat16 tiles are loaded and stored a whole row at a
    time, their words transposed by two-source permutes (``tiles.permutes``); built without
    them (the half-row loads and stores, the in-lane interleaves), GAE, the returns and
    REINFORCE++ give the very same bits, int16 views compared (signed zeros, NaN payloads),
    on rows with subnormals, NaN and inf, with and without masks, whole and in pieces."""
    import numpy as np

    from rlops.scan import tiles

    if native and not _target_has_native_bf16():
        pytest.skip("the target has no AVX-512 BF16")
    r, v = _special_tiles(rows, t)
    g = torch.Generator().manual_seed(rows + t)
    kl = (torch.randn(rows, t, generator=g) * 0.1).to(BF16)
    kl[0, 100] = float("nan")
    kl[min(2, rows - 1), -20:] = 1e-39  # subnormal token rewards
    outcome = torch.randn(rows, generator=g)
    masks = {
        "none": None,
        "random": (torch.rand(rows, t, generator=g) < 0.8).numpy(),
        "right-padded": (
            torch.arange(t) < torch.randint(t // 2, t + 1, (rows, 1), generator=g)
        ).numpy(),
    }
    groups, n_tiles = -(-rows // tiles.WIDTH), t // tiles.TOKENS
    pieces = [[(0, n_tiles)], [(0, n_tiles - n_tiles // 3), (n_tiles - n_tiles // 3, n_tiles // 3)]]
    f32 = np.float32
    zero, one = np.zeros(rows, f32), np.ones(rows, f32)
    bits = [x.view(torch.uint16).numpy() for x in (r, v, kl)]

    def run(paths: dict) -> list:
        with _built(tiles.gae, tiles.reinforce, **paths) as (gae, rpp):
            return [o for mask in masks.values() for o in calls(gae, rpp, mask)]

    def calls(gae, rpp, mask) -> list:
        outs = []
        for parts in pieces:
            o = [np.full((rows, t), 0x1234, np.uint16) for _ in range(4)]
            for skip, take in parts:
                a = (bits[0], bits[1], mask, None, None, zero, one, np.full(rows, 0.95))
                gae(*a, o[0], o[1], 0, groups, skip, take)
                a = (bits[0], None, mask, None, None, zero, one, np.full(rows, 0.99))
                gae(*a, None, o[2], 0, groups, skip, take)
                if mask is not None:
                    a = (bits[2], outcome.numpy(), np.full(1, -0.1, f32), mask)
                    rpp(*a, np.full(rows, 0.99), o[3], 0, groups, skip, take)
            outs += o
        return outs

    whole = run({"permutes": True, "native_bf16": native})
    halves = run({"permutes": False, "native_bf16": native})
    for a, b in zip(whole, halves, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.skipif(not _target_has_permutes(), reason="the target has no AVX-512 BW")
def test_whole_row_tiles_are_built_where_the_target_has_the_permutes():
    import numpy as np

    from rlops.scan import tiles

    x = torch.zeros(8, 64, dtype=BF16).view(torch.uint16).numpy()
    zero, one = np.zeros(8, np.float32), np.ones(8, np.float32)
    asm = {}
    for on in (True, False):
        with _built(tiles.gae, permutes=on) as (kernel,):
            kernel(x, x, None, None, None, zero, one, np.ones(8), x.copy(), x.copy(), 0, 1, 0, 4)
        asm[on] = kernel.inspect_asm(kernel.signatures[0])
    assert "vpermt2d" in asm[True] or "vpermi2d" in asm[True]
    assert "vpermt2d" not in asm[False] and "vpermi2d" not in asm[False]
