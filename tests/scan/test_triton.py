"""The Triton scan family under the CPU interpreter, against the references and the oracles.

``rlops.scan.triton.reverse_scan`` (scalar, per-row, per-token decays, ``y_boot``, autograd),
and ``rlops.advantages.triton``'s GAE, discounted returns and REINFORCE++ returns, at small
shapes with several blocks of time per row (``block_t``), so that the carries between blocks
are exercised. Accuracy rule of ``tests/tolerances.py``: float32 and float64 within twice the
serial reference's error in the same dtype against the oracle (extended precision for
float64; the carries are float32, so the serial float32 loop, not the float64-carry compiled
path, sets the bar); bfloat16 within one ulp of the float32 reference
rounded (plus the float32 budget).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from tests._triton_interp import (  # (sets TRITON_INTERPRET=1 first)
    random_decay,
    seeded,
    triton,  # noqa: F401
)
from tests.oracles import (
    EXTENDED,
    discounted_cumsum_oracle,
    discounted_returns_oracle,
    gae_oracle,
)
from tests.tolerances import assert_half_matches, assert_within_reference

import rlops
from rlops.advantages._masking import GaeInputs
from rlops.advantages.reference import gae_reference
from rlops.advantages.triton import gae_triton, reinforce_returns_triton
from rlops.scan.reference import scan_reference
from rlops.scan.triton import block_size, reverse_scan

SHAPES = [(1, 1), (3, 127), (2, 128), (2, 129), (1, 1000)]


def _check_scan(name, out, x, a):
    """The accuracy rule for one scan output ``out`` of input ``x`` (float32/64/bfloat16)."""
    assert out.dtype == x.dtype and out.shape == x.shape, (out.dtype, out.shape)
    if x.dtype == torch.bfloat16:
        a32 = a.float() if isinstance(a, torch.Tensor) else a
        ref32 = scan_reference(x.float(), a32)
        oracle = discounted_cumsum_oracle(x, a)
        assert_half_matches(name, out, ref32, oracle)
        return
    extended = EXTENDED and x.dtype == torch.float64
    oracle = discounted_cumsum_oracle(x, a, extended=extended)
    ref = scan_reference(x, a)
    assert_within_reference(name, out, oracle, ref)


CASES = [
    pytest.param(b, t, kind, d, dt, id=f"{dt}-{kind}-{d}-B{b}-T{t}")
    for (b, t), kind, d, dt in itertools.chain(
        itertools.product(SHAPES, ["scalar", "row", "token"], [0.97], ["float32"]),
        itertools.product([(2, 129), (1, 1000)], ["scalar", "token"], [0.97], ["float64"]),
        itertools.product([(2, 129)], ["scalar", "token"], [0.0, 1.0], ["float32"]),
        itertools.product([(2, 300)], ["scalar", "token"], [0.97], ["bfloat16"]),
    )
]


@pytest.mark.parametrize(("b", "t", "kind", "d", "dtype"), CASES)
def test_reverse_scan_matches_reference(b, t, kind, d, dtype):
    gen = seeded(b, t, kind, d, dtype)
    dt = getattr(torch, dtype)
    x = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dt)
    a = random_decay(kind, d, b, t, dt, gen)
    out = reverse_scan(x, a, block_t=64 if t < 1000 else 256)
    _check_scan(f"{dtype} {kind} d={d} [{b}, {t}]", out, x, a)


def test_reverse_scan_long_row_default_blocks():
    """T = 4096 with the default block (several blocks, one carry scan) at discount 1."""
    gen = seeded("long")
    x = torch.randn(1, 4096, generator=gen)
    assert block_size() < 4096
    _check_scan("T=4096, d=1", reverse_scan(x, 1.0), x, 1.0)


def test_reverse_scan_many_blocks_tile_loop():
    """More blocks than one tile of the carry scan: the carry crosses tiles of blocks."""
    import rlops.scan.triton as st

    gen = seeded("tiles")
    x = torch.randn(2, 300, generator=gen, dtype=torch.float64)
    a = random_decay("token", 0.9, 2, 300, torch.float64, gen)
    saved = st._CARRY_BLOCK
    st._CARRY_BLOCK = 16  # 19 blocks of 16 steps: two tiles of the carry scan
    try:
        out = reverse_scan(x, a, block_t=16)
    finally:
        st._CARRY_BLOCK = saved
    _check_scan("carry tiles", out, x, a)


def test_nan_beyond_a_cut_does_not_leak():
    """A zero decay is a cut: NaN and inf after it, in another block, stay after it."""
    x = torch.randn(2, 200, generator=seeded("nan"))
    a = torch.full((2, 200), 0.9)
    a[:, 70] = 0.0
    x[0, 150] = float("nan")
    x[1, 71] = float("inf")
    y = reverse_scan(x, a, block_t=16)
    assert torch.isfinite(y[:, :71]).all()
    assert torch.isnan(y[0, 71:151]).all() and torch.isinf(y[1, 71]).all()
    torch.testing.assert_close(y[:, :71], scan_reference(x[:, :71], a[:, :71]))


def test_scalar_discount_zero_is_identity():
    x = torch.randn(3, 100, generator=seeded("zero"))
    assert torch.equal(reverse_scan(x, 0.0, block_t=16), x)


def test_y_boot_is_the_value_past_the_end():
    """``y_boot`` acts as one more step ``x[T] = y_boot`` (definition of the bootstrap)."""
    gen = seeded("boot")
    x = torch.randn(3, 77, generator=gen, dtype=torch.float64)
    a = random_decay("token", 0.95, 3, 77, torch.float64, gen)
    boot = torch.randn(3, generator=gen, dtype=torch.float64)
    out = reverse_scan(x, a, y_boot=boot, block_t=16)
    longer = scan_reference(torch.cat([x, boot[:, None]], 1), torch.cat([a, a[:, :1]], 1))
    torch.testing.assert_close(out, longer[:, :-1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_empty(shape):
    x = torch.randn(shape)
    assert reverse_scan(x, 0.9).shape == shape
    g = torch.full((shape[0],), 0.9)
    adv, ret = gae_triton(GaeInputs(x, x, None, None, g, g))
    assert adv.shape == ret.shape == shape


@pytest.mark.parametrize("kind", ["row", "token"])
def test_reverse_scan_gradients_match_reference_autograd(kind):
    gen = seeded("grad", kind)
    b, t = 3, 150
    x = torch.randn(b, t, generator=gen, dtype=torch.float64)
    a = random_decay(kind, 0.9, b, t, torch.float64, gen)
    g = torch.randn(b, t, generator=gen, dtype=torch.float64)
    x1, a1 = x.clone().requires_grad_(), a.clone().requires_grad_()
    reverse_scan(x1, a1, block_t=32).backward(g)
    x2, a2 = x.clone().requires_grad_(), a.clone().requires_grad_()
    scan_reference(x2, a2).backward(g)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(a1.grad, a2.grad, rtol=1e-10, atol=1e-12)


def test_reverse_scan_gradcheck_with_boot():
    gen = seeded("gradcheck")
    x = torch.randn(2, 37, generator=gen, dtype=torch.float64, requires_grad=True)
    a = (0.5 + 0.5 * torch.rand(2, 37, generator=gen, dtype=torch.float64)).requires_grad_()
    # fast mode: a few random directions instead of one forward per input element
    boot = torch.randn(2, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, a, y: reverse_scan(x, a, y_boot=y, block_t=16), (x, a, boot), fast_mode=True
    )


# ------------------------------------------------------------------ GAE and returns
def _indicators(b, t, gen, mask, dones, p_mask=0.7, p_done=0.03):
    m = (torch.rand(b, t, generator=gen) < p_mask) if mask else None
    d = (torch.rand(b, t, generator=gen) < p_done) if dones else None
    return m, d


def _rows(v, b, dtype):
    return torch.as_tensor(v, dtype=torch.float64).expand(b).to(dtype)


GAE_CASES = [
    pytest.param(b, t, m, d, g, lam, dt, id=f"{dt}-m{int(m)}-d{int(d)}-g{g}-l{lam}-B{b}-T{t}")
    for (b, t), m, d, (g, lam), dt in itertools.chain(
        itertools.product(SHAPES, [False, True], [False, True], [(0.99, 0.95)], ["float32"]),
        itertools.product(
            [(2, 300)], [True], [True], [(0.0, 0.95), (1.0, 1.0), (0.99, 0.0)], ["float32"]
        ),
        itertools.product([(2, 129)], [True], [True], [(0.99, 0.95)], ["float64"]),
        itertools.product([(1, 4096)], [True], [True], [(1.0, 0.95)], ["float32"]),
    )
]


@pytest.mark.parametrize(("b", "t", "mask", "dones", "gamma", "lam", "dtype"), GAE_CASES)
def test_gae_and_returns_match_reference(b, t, mask, dones, gamma, lam, dtype):
    gen = seeded("gae", b, t, mask, dones, gamma, lam, dtype)
    dt = getattr(torch, dtype)
    r = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dt)
    v = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dt)
    m, d = _indicators(b, t, gen, mask, dones)
    g, gl = _rows(gamma, b, dt), _rows(gamma * lam, b, dt)
    block = 64 if t < 1000 else (256 if t == 1000 else None)
    adv, ret = gae_triton(GaeInputs(r, v, m, d, g, gl), block_t=block)
    extended = EXTENDED and dt == torch.float64
    o_adv, o_ret = gae_oracle(r, v, gamma, lam, m, d, extended=extended)
    ref_adv, ref_ret = gae_reference(GaeInputs(r, v, m, d, g, gl))
    assert_within_reference("advantages", adv, o_adv, ref_adv)
    assert_within_reference("returns", ret, o_ret, ref_ret)

    out, same = gae_triton(GaeInputs(r, None, m, d, g, g), block_t=block)
    assert out is same
    o_g = discounted_returns_oracle(r, gamma, m, d, extended=extended)
    ref_g = gae_reference(GaeInputs(r, None, m, d, g, g))[1]
    assert_within_reference("discounted returns", out, o_g, ref_g)


def test_gae_per_row_discounts_and_empty_rows():
    gen = seeded("rows")
    b, t = 4, 200
    r, v = torch.randn(b, t, generator=gen), torch.randn(b, t, generator=gen)
    m, d = _indicators(b, t, gen, True, True)
    m[1] = False  # a row with no action token
    gamma = torch.tensor([0.9, 0.99, 1.0, 0.0])
    lam = torch.tensor([0.95, 0.5, 1.0, 0.9])
    adv, ret = gae_triton(GaeInputs(r, v, m, d, gamma, gamma * lam), block_t=32)
    o_adv, o_ret = gae_oracle(r, v, gamma, lam, m, d)
    ref_adv, ref_ret = gae_reference(GaeInputs(r, v, m, d, gamma, gamma * lam))
    assert_within_reference("advantages", adv, o_adv, ref_adv)
    assert_within_reference("returns", ret, o_ret, ref_ret)
    assert (adv[1] == 0).all() and (ret[1] == 0).all()


def test_gae_nan_beyond_a_done():
    """NaN rewards and values after a done (another packed sequence) stay after it."""
    gen = seeded("gae-nan")
    r, v = torch.randn(2, 160, generator=gen), torch.randn(2, 160, generator=gen)
    d = torch.zeros(2, 160, dtype=torch.bool)
    d[:, 40] = True
    r[:, 41:] = float("nan")
    v[:, 41:] = float("nan")
    g = torch.full((2,), 0.99)
    adv, ret = gae_triton(GaeInputs(r, v, None, d, g, g * 0.95), block_t=16)
    assert torch.isfinite(adv[:, :41]).all() and torch.isfinite(ret[:, :41]).all()
    ref_adv, _ = gae_reference(GaeInputs(r[:, :41], v[:, :41], None, None, g, g * 0.95))
    torch.testing.assert_close(adv[:, :41], ref_adv)


def test_gae_bfloat16_inputs():
    gen = seeded("gae-bf16")
    b, t = 2, 300
    r = torch.randn(b, t, generator=gen).bfloat16()
    v = torch.randn(b, t, generator=gen).bfloat16()
    m, d = _indicators(b, t, gen, True, True)
    g = torch.full((b,), 0.99)
    adv, ret = gae_triton(GaeInputs(r, v, m, d, g, g * 0.95), block_t=64)
    assert adv.dtype == ret.dtype == torch.bfloat16
    ref_adv, ref_ret = gae_reference(GaeInputs(r.float(), v.float(), m, d, g, g * 0.95))
    o_adv, o_ret = gae_oracle(r, v, 0.99, 0.95, m, d)
    # the oracle's gamma * lam is exact, the carries' is float32: both round it once
    assert_half_matches("advantages", adv, ref_adv, o_adv)
    assert_half_matches("returns", ret, ref_ret, o_ret)


@pytest.mark.parametrize(
    ("dtype", "gamma"), [("float32", 0.99), ("float64", 0.9), ("float32", 1.0), ("float32", 0.0)]
)
def test_reinforce_returns_match_reference(dtype, gamma):
    gen = seeded("rpp", dtype, gamma)
    dt = getattr(torch, dtype)
    b, t = 4, 333
    kl = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dt)
    outcome = torch.randn(b, generator=gen, dtype=torch.float64).to(dt)
    m = torch.rand(b, t, generator=gen) < 0.6
    m[1] = False  # no action token: 0s
    m[2, 300:] = False  # the outcome lands well before the row's end, across blocks
    out = reinforce_returns_triton(kl, outcome, m, 0.05, _rows(gamma, b, dt), block_t=128)
    ref = rlops.reinforce_plus_plus_returns(
        outcome, kl, m, kl_coef=0.05, gamma=gamma, method="reference"
    )
    # the oracle: the same token rewards (rounded as the reference does) over compacted rows
    tok = torch.where(m, -0.05 * kl, 0.0)
    last = (t - 1) - m.flip(-1).to(torch.uint8).argmax(-1)
    for row in range(b):
        if m[row].any():
            tok[row, last[row]] += outcome[row]
    extended = EXTENDED and dt == torch.float64
    oracle = discounted_returns_oracle(tok, gamma, m, extended=extended)
    assert_within_reference("REINFORCE++ returns", out, oracle, ref)
    assert (out[1] == 0).all()
