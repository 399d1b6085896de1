"""The vector kernels of ``rlops.scan.tiles`` (eight rows in the lanes of one vector, tiles of 8
or 16 tokens, the tokens before the last whole tile one at a time):

* a row's output bits do not depend on the rows beside it, on its group (a short last group
  repeats its last row) or on the thread count: each row of a batch equals that row alone;
* every length around the tile sizes (1, 7, 8, 9, 15, 16, 17, 31, 33, 130) and around the
  rows' skew (from 64 tiles of 16 tokens on, row i walks its tiles i steps after row 0: 1023,
  1024, 1040, 3001) matches the plain loop in float64 rounded once, within the float32
  rounding of the outputs;
* the bool tile (bytes shifted into lane masks) reads each token's own mask: a mask with one
  token off per row, at every position of a tile, zeroes exactly that token.
"""

from __future__ import annotations

import pytest
import torch
from tests.tolerances import needs_numba

import rlops

pytestmark = needs_numba

LENGTHS = [1, 7, 8, 9, 15, 16, 17, 31, 33, 130, 1023, 1024, 1040, 3001]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def _inputs(n: int, t: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(n, t, generator=g).to(dtype)
    v = torch.randn(n, t, generator=g).to(dtype)
    kl = (torch.randn(n, t, generator=g) * 0.1).to(dtype)
    outcome = torch.randn(n, generator=g).to(dtype)
    mask = torch.rand(n, t, generator=g) > 0.3
    dones = torch.rand(n, t, generator=g) > 0.9
    truncated = dones & (torch.rand(n, t, generator=g) > 0.5)
    bootstrap = torch.randn(n, t, generator=g).to(dtype)
    return r, v, kl, outcome, mask, dones, truncated, bootstrap


def _calls(n: int, t: int, dtype: torch.dtype, rows: slice = slice(None)) -> dict:
    """Every kind of compiled tile call on the ``rows`` of ``[n, t]`` inputs."""
    inputs = (x[rows] for x in _inputs(n, t, dtype, 0))
    r, v, kl, outcome, mask, dones, truncated, bootstrap = inputs
    ends = {"dones": dones, "truncated": truncated, "bootstrap": bootstrap}
    kw = {"gamma": 0.99, "lam": 0.95, "method": "compiled"}
    return {
        "gae": lambda: rlops.gae(r, v, **kw),
        "gae mask": lambda: rlops.gae(r, v, mask=mask, **kw),
        "gae mask dones": lambda: rlops.gae(r, v, mask=mask, **ends, **kw),
        "returns": lambda: rlops.discounted_returns(r, gamma=0.99, method="compiled"),
        "returns mask dones": lambda: rlops.discounted_returns(
            r, gamma=0.97, mask=mask, **ends, method="compiled"
        ),
        "reinforce++": lambda: rlops.reinforce_plus_plus_returns(
            outcome, kl, mask, kl_coef=0.1, gamma=0.99, method="compiled"
        ),
        "cumsum": lambda: rlops.discounted_cumsum(r, 0.9, method="compiled"),
    }


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [9, 17, 130, 1043])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(dtype, t):
    n = 11  # a full group of eight and a short one of three
    batch = {k: _flat(f()) for k, f in _calls(n, t, dtype).items()}
    for i in (0, 7, 8, 10):
        alone = {k: _flat(f()) for k, f in _calls(n, t, dtype, slice(i, i + 1)).items()}
        for k in batch:
            for got, want in zip(alone[k], batch[k], strict=True):
                assert _same(got[0], want[i]), (k, i)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 4099), (8, 32771), (6, 43701)])
def test_the_bits_do_not_depend_on_the_thread_count(dtype, shape):
    """1 thread: one call on every group of eight rows; 2 threads: the groups split over the
    threads where there are several."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = {k: _flat(f()) for k, f in _calls(*shape, dtype).items()}
        torch.set_num_threads(2)
        two = {k: _flat(f()) for k, f in _calls(*shape, dtype).items()}
    finally:
        torch.set_num_threads(before)
    for k in one:
        for a, b in zip(one[k], two[k], strict=True):
            assert _same(a, b), k


def _pieces_calls(n: int, t: int, dtype: torch.dtype, cuts: list[int]) -> dict:
    """Every kind of tile kernel call on ``[n, t]`` inputs, run piece by piece: piece ``j``
    walks the rows' last ``cuts[j]`` whole tiles for the carries alone, then writes its tiles
    up to ``cuts[j + 1]`` (and the tokens before the first whole tile in the last piece)."""
    import numpy as np

    from rlops.scan import tiles
    from rlops.scan.compiled import bits, per_row

    r, v, kl, outcome, mask, dones, truncated, bootstrap = _inputs(n, t, dtype, 0)
    wide = torch.float32 if dtype == torch.bfloat16 else dtype
    groups = -(-n // tiles.WIDTH)
    cut = torch.where(truncated, bootstrap.to(wide), 0.0).numpy()
    g, gl = per_row(0.99, n, wide).numpy(), per_row(0.99 * 0.95, n, torch.float64).numpy()
    spans = list(zip(cuts[:-1], np.diff(cuts).tolist(), strict=True))

    def run(kernel, *args, outputs):
        outs = [torch.empty(n, t, dtype=dtype) for _ in range(outputs)]
        arrays = [bits(o) for o in outs]
        args = [arrays.pop(0) if isinstance(a, str) else a for a in args]
        for skip, take in spans[::-1]:  # any order: the pieces write apart
            kernel(*args, 0, groups, skip, take)
        return outs

    zero = per_row(0.0, n, wide).numpy()
    m, d = mask.numpy(), (dones | truncated).numpy()
    return {
        "gae": lambda: run(
            tiles.gae, bits(r), bits(v), None, None, None, zero, g, gl, "out", "out", outputs=2
        ),
        "gae mask dones": lambda: run(
            tiles.gae, bits(r), bits(v), m, d, cut, zero, g, gl, "out", "out", outputs=2
        ),
        "returns mask": lambda: run(
            tiles.gae,
            bits(r),
            None,
            m,
            None,
            None,
            zero,
            g,
            g.astype("float64"),
            None,
            "out",
            outputs=1,
        ),
        "reinforce++": lambda: run(
            tiles.reinforce,
            bits(kl),
            per_row(outcome, n, wide).numpy(),
            per_row(-0.1, 1, wide).numpy(),
            m,
            gl,
            "out",
            outputs=1,
        ),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("t", "cuts"),
    [
        (1043, [0, 20, 65]),  # short pieces (rows not skewed), and the 3 tokens before them
        (1043, [0, 65]),  # the whole row in one piece
        (4099, [0, 1, 64, 130, 256]),  # a one-tile piece; skewed (64 tiles) and not
        (2048, [0, 70, 128]),  # no token before the first whole tile
        (17, [0, 0, 1]),  # an empty piece
    ],
)
def test_a_row_split_in_time_gives_the_bits_of_one_pass(dtype, t, cuts):
    """Pieces that walk the tiles after theirs for the carries alone (``skip``) and write their
    own (``take``) give, together, the bits of the whole row written in one pass."""
    n = 11
    whole = _pieces_calls(n, t, dtype, [0, t // 16])
    split = _pieces_calls(n, t, dtype, cuts)
    for k in whole:
        for a, b in zip(whole[k](), split[k](), strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), k


@pytest.fixture
def small_splits(monkeypatch):
    """Rows split over threads, and in time, from 4K elements: the shares kept per shape
    (``compiled._shares``) are dropped before and after, so that none made with the real
    sizes is taken here, and none made here is taken later."""
    from rlops.scan import compiled

    monkeypatch.setattr(compiled, "_MIN_ELEMENTS_PER_PIECE", 1 << 12)
    monkeypatch.setattr(compiled, "_MIN_ELEMENTS_PER_THREAD", 1 << 12)
    compiled._shares.cache_clear()
    yield compiled
    compiled._shares.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_split_in_time_over_threads_give_the_bits_of_one_thread(dtype, small_splits):
    """Eight rows are one group: at 2 threads, with the size from which rows are split in time
    lowered to this test's, each row runs as two pieces on two threads."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = {k: _flat(f()) for k, f in _calls(8, 32771, dtype).items()}
        torch.set_num_threads(2)
        two = {k: _flat(f()) for k, f in _calls(8, 32771, dtype).items()}
    finally:
        torch.set_num_threads(before)
    for k in one:
        for a, b in zip(one[k], two[k], strict=True):
            assert _same(a, b), k


def _gae_loop(r, v, gamma, lam, mask=None):
    """GAE by its definition, in float64: delta = r + gamma * V(next kept token) - V, the
    advantage carried back over kept tokens only (mask-0 tokens give 0)."""
    r, v = r.double(), v.double()
    n, t = r.shape
    adv = torch.zeros(n, t, dtype=torch.float64)
    for i in range(n):
        nxt, acc = 0.0, 0.0
        for s in range(t - 1, -1, -1):
            if mask is not None and not mask[i, s]:
                continue
            delta = r[i, s] + gamma * nxt - v[i, s]
            acc = delta + gamma * lam * acc
            adv[i, s] = acc
            nxt = v[i, s]
    return adv


@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("masked", [False, True])
def test_every_length_around_the_tiles_matches_the_definition(t, masked):
    r, v, _, _, mask, *_ = _inputs(9, t, torch.float32, t)
    m = mask if masked else None
    adv, ret = rlops.gae(r, v, gamma=0.99, lam=0.95, mask=m, method="compiled")
    want = _gae_loop(r, v, 0.99, 0.95, m)
    # one rounding of the float64 carry to float32 (half an ulp of the largest output), and
    # the float32 TD residual's (|delta| <~ 6, within 1e-6 each, summed over ~20 tokens)
    tol = 1e-5 * max(1.0, want.abs().max().item())
    assert (adv.double() - want).abs().max().item() <= tol
    want_ret = torch.where(m, want + v.double(), 0.0) if masked else want + v.double()
    assert (ret.double() - want_ret).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [67, 1031])
def test_each_token_reads_its_own_mask(dtype, t):
    # row i is off at tokens i, i + 9, i + 18, ...: every position of a tile, in every lane
    n = 8
    r = torch.ones(n, t, dtype=dtype)
    mask = torch.ones(n, t, dtype=torch.bool)
    for i in range(n):
        mask[i, i::9] = False
    ret = rlops.discounted_returns(r, gamma=1.0, mask=mask, method="compiled")
    assert torch.equal(ret == 0, ~mask)
    # the return counts the kept tokens from here to the row's end
    want = mask.flip(-1).cumsum(-1).flip(-1).to(dtype) * mask
    assert torch.equal(ret, want)


_OTHER_CPU = """
import sys, torch
sys.path[:0] = {path!r}
from tests.scan.test_tiles import _calls, _flat
out = {{k: _flat(f()) for k, f in _calls(11, 1043, getattr(torch, {dtype!r})).items()}}
torch.save(out, {file!r})
"""


@pytest.mark.parametrize("cpu", ["generic", "haswell"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernels_give_the_same_bits_built_for_other_cpus(cpu, dtype, tmp_path):
    """Built for x86-64 without AVX (``generic``: the vector IR lowered to SSE2, the fused
    multiply-add a libm call) and for AVX2 without AVX-512 (``haswell``), the kernels give the
    bits they give on this machine."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    file = str(tmp_path / "out.pt")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = _OTHER_CPU.format(path=[root], dtype=dtype, file=file)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)
    theirs = torch.load(file)
    ours = {k: _flat(f()) for k, f in _calls(11, 1043, getattr(torch, dtype)).items()}
    for k in ours:
        for a, b in zip(ours[k], theirs[k], strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (cpu, k)


def _plain_gae():
    """The float32 GAE step written plainly, one row and one token at a time (numba, the
    float64 carry advanced by one fused multiply-add), as the kernels' lanes must run it."""
    import numba
    import numpy as np

    from rlops.scan.exact_arith import fma

    @numba.njit
    def run(r, v, end, g, gl, adv, ret):
        for i in range(r.shape[0]):
            acc, nxt = 0.0, end[i]
            for t in range(r.shape[1] - 1, -1, -1):
                delta = np.float32(np.float32(r[i, t] + np.float32(g[i] * nxt)) - v[i, t])
                acc = fma(gl[i], acc, np.float64(delta))
                adv[i, t] = np.float32(acc)
                ret[i, t] = np.float32(adv[i, t] + v[i, t])
                nxt = v[i, t]

    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 8, 11])
@pytest.mark.parametrize("t", LENGTHS)
def test_gae_without_a_mask_on_whole_tiles_is_the_plain_step_bit_for_bit(dtype, n, t):
    """GAE without a mask makes its TD residuals and returns apart from the carry's step:
    float32 a row at a time (``tiles.Rows``: each row's next values the row shifted by one
    token, the last one carried from the tile after), bfloat16 on token pairs (tokens 2j and
    2j + 8, then 2j + 1 and 2j + 9, in one vector): the bits of the step written plainly in
    float32 (a bfloat16 call: on the values it holds, each output rounded once by torch), in
    one pass and in pieces."""
    import numpy as np

    from rlops.scan import tiles
    from rlops.scan.compiled import bits

    r, v, *_ = _inputs(n, t, dtype, seed=t)
    g = torch.Generator().manual_seed(n)
    end = torch.randn(n, generator=g).numpy()
    gamma = (torch.rand(n, generator=g) * 0.5 + 0.5).numpy()
    gl = (torch.rand(n, generator=g, dtype=torch.float64) * 0.99).numpy()
    wide = torch.empty(n, t), torch.empty(n, t)
    _plain_gae()(r.float().numpy(), v.float().numpy(), end, gamma, gl, *(w.numpy() for w in wide))
    want = [w.to(dtype) for w in wide]
    n_tiles, groups = t // tiles.TOKENS, -(-n // tiles.WIDTH)
    cut = n_tiles // 3 + 1
    for spans in ([(0, n_tiles)], [(cut, n_tiles - cut), (0, cut)]):
        got = torch.full((n, t), np.nan, dtype=dtype), torch.full((n, t), np.nan, dtype=dtype)
        arrays = (bits(r), bits(v), None, None, None, end, gamma, gl)
        for skip, take in spans:
            tiles.gae(*arrays, *(bits(x) for x in got), 0, groups, skip, take)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), spans


def _span_masks(n: int, t: int, seed: int) -> torch.Tensor:
    """Masks of long spans, as responses and tool outputs make them: right-padded rows, and
    turns of 30 to 400 tokens shared by the rows with a few tokens of jitter, so that whole
    tiles of every row are on, or off, or mixed."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(t // 2, t + 1, (n, 1), generator=g)
    padded = torch.arange(t) < lengths
    edges = torch.randint(30, 400, (t // 30 + 1,), generator=g).cumsum(0)
    turn = (torch.bucketize(torch.arange(t), edges) % 2 == 0).expand(n, t).clone()
    jitter = torch.randint(0, 5, (n,), generator=g)
    for i in range(n):
        turn[i] = turn[i].roll(int(jitter[i]))
    return torch.cat([padded[: n // 2], turn[n // 2 :]])


def _compacted(fn, mask: torch.Tensor, *rows: torch.Tensor) -> torch.Tensor:
    """``fn`` on each row's action tokens alone (an unmasked ``[1, L]`` call), scattered back
    with 0 on mask-0 tokens: what skipping mask-0 tokens means."""
    out = torch.zeros(mask.shape, dtype=rows[0].dtype)
    for i in range(mask.shape[0]):
        keep = mask[i]
        if keep.any():
            out[i, keep] = fn(i, *(x[i, keep][None] for x in rows))[0]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [130, 1040, 3001, 9000])
@pytest.mark.parametrize("threads", [1, 2])
def test_masked_tiles_give_the_bits_of_the_action_tokens_alone(dtype, t, threads, small_splits):
    """Tiles where every row's tokens are action tokens (float32 GAE takes them a row at a
    time) or none are (zeros stored, nothing computed): the masked kernels give, on each row,
    the bits of the unmasked kernel on that row's action tokens alone, and 0 elsewhere; at 1
    thread on 11 rows (a short last group), at 2 threads on 8 rows, split in time from 3001
    tokens (each piece walking the tiles after it for their carries)."""
    from rlops.scan import tiles

    n = 11 if threads == 1 else 8
    if threads == 2 and t >= 3001:  # one group, two pieces in time
        assert len(small_splits._shares(n, n * t, tiles.WIDTH, t // tiles.TOKENS, 2, 0.5)) == 2
    r, v, kl, outcome, *_ = _inputs(n, t, dtype, seed=t)
    mask = _span_masks(n, t, seed=t)
    kw = {"gamma": 0.99, "method": "compiled"}
    compacted = {
        "gae": lambda i, r, v: rlops.gae(r, v, lam=0.95, **kw),
        "returns": lambda i, r: rlops.discounted_returns(r, **kw),
        "reinforce++": lambda i, kl: rlops.reinforce_plus_plus_returns(
            outcome[i : i + 1], kl, torch.ones_like(kl, dtype=torch.bool), kl_coef=0.1, **kw
        ),
    }
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        adv, ret = rlops.gae(r, v, lam=0.95, mask=mask, **kw)
        got = {
            "gae advantages": adv,
            "gae returns": ret,
            "returns": rlops.discounted_returns(r, mask=mask, **kw),
            "reinforce++": rlops.reinforce_plus_plus_returns(outcome, kl, mask, kl_coef=0.1, **kw),
        }
        want = {
            "gae advantages": _compacted(lambda i, r, v: compacted["gae"](i, r, v)[0], mask, r, v),
            "gae returns": _compacted(lambda i, r, v: compacted["gae"](i, r, v)[1], mask, r, v),
            "returns": _compacted(compacted["returns"], mask, r),
            "reinforce++": _compacted(compacted["reinforce++"], mask, kl),
        }
    finally:
        torch.set_num_threads(threads_before)
    ints = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}
    for name, x in got.items():
        assert torch.equal(x.view(ints[dtype]), want[name].view(ints[dtype])), name
