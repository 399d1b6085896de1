"""KL estimators and their straight-through variants against 40-digit references."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests._losses_util import DTYPES, acc_dtype, assert_within_ref_error

from rlops.losses import KL_KINDS, kl_penalty

mpmath.mp.dps = 40


def mp(x):
    return mpmath.mpf(float(x))


def make_logps(dtype, seed, spread, b=6, t=29):
    gen = torch.Generator().manual_seed(seed)
    ref = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    logp = ref + spread * torch.randn(b, t, generator=gen, dtype=torch.float64)
    return logp.to(dtype), ref.to(dtype)


def ref_kl(d, kind):
    """One token, in 40-digit arithmetic (``d`` an mpf) or in a torch dtype (``d`` a tensor)."""
    if isinstance(d, torch.Tensor):
        if kind == "k1":
            return d
        if kind == "abs":
            return d.abs()
        if kind == "k2":
            return 0.5 * d * d
        k3 = torch.exp(-d.clamp_min(-20)) - 1 + d.clamp_min(-20)  # verl's formula
        return k3 if kind == "k3" else k3.clamp(-10, 10)
    k3 = mpmath.exp(-max(d, -20)) - 1 + max(d, -20)
    return {"k1": d, "abs": abs(d), "k2": d * d / 2, "k3": k3, "low_var_kl": min(k3, 10)}[kind]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3", "low_var_kl"])
def test_kl_matches_reference(kind, dtype):
    logp, ref = make_logps(dtype, 0, spread=2.0)
    out = kl_penalty(logp, ref, kind)
    assert out.dtype == dtype and out.shape == logp.shape
    d64 = [mp(a) - mp(b) for a, b in zip(logp.flatten(), ref.flatten(), strict=True)]
    exact = torch.tensor([float(ref_kl(d, kind)) for d in d64], dtype=torch.float64)
    acc = acc_dtype(dtype)
    same = ref_kl(logp.to(acc) - ref.to(acc), kind).to(dtype)
    assert_within_ref_error(out, exact.view(logp.shape), same)
    for alias, base in (("kl", "k1"), ("mse", "k2")):
        if kind == base:
            assert torch.equal(kl_penalty(logp, ref, alias), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_k3_is_accurate_for_small_log_ratios(dtype):
    # exp(−d) − 1 + d cancels to noise for |d| ≪ 1; expm1(−d) + d keeps the relative error at a
    # few ulps: rounding of d (propagated by |k3'(d)| ≤ |d|), expm1 and the final sum.
    d = torch.logspace(-6, 0, 61, dtype=torch.float64).to(dtype)
    d = torch.cat([d, -d])
    zero = torch.zeros_like(d)
    out = kl_penalty(d, zero, "k3").double()
    exact = torch.tensor([float(ref_kl(mp(v), "k3")) for v in d], dtype=torch.float64)
    eps = torch.finfo(dtype).eps
    bound = 3 * eps * (d.double().abs() + exact)
    assert ((out - exact).abs() <= bound).all()
    naive = (torch.exp(-d) - 1 + d).double()
    assert ((naive - exact).abs() > bound).any()  # the trap this avoids
    assert (out >= 0).all()


@settings(max_examples=100, deadline=None)
@given(st.floats(-1e4, 1e4, allow_nan=False), st.floats(-1e4, 1e4, allow_nan=False))
def test_k3_is_nonnegative_and_every_kind_is_finite(a, b):
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        logp, ref = torch.tensor([a], dtype=dtype), torch.tensor([b], dtype=dtype)
        for kind in KL_KINDS:
            assert torch.isfinite(kl_penalty(logp, ref, kind)).all(), (kind, dtype)
        assert kl_penalty(logp, ref, "k3") >= 0 and kl_penalty(logp, ref, "low_var_kl") <= 10


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3", "low_var_kl", "kl", "mse"])
def test_straight_through_value_of_kind_gradient_of_k2(kind, dtype):
    logp, ref = make_logps(dtype, 1, spread=4.0)
    lp = logp.clone().requires_grad_(True)
    out = kl_penalty(lp, ref, kind + "+")
    assert torch.equal(out.detach(), kl_penalty(logp, ref, kind))
    upstream = torch.randn(logp.shape, dtype=dtype)
    (g_lp,) = torch.autograd.grad(out, lp, upstream)
    (e_lp,) = torch.autograd.grad(kl_penalty(lp, ref, "k2"), lp, upstream)
    assert torch.equal(g_lp, e_lp)


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3", "low_var_kl"])
def test_gradcheck_kl_kinds_and_straight_through(kind):
    gen = torch.Generator().manual_seed(2)
    lp = torch.randn(2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    rp = lp.detach() + 0.7 * torch.randn(2, 3, generator=gen, dtype=torch.float64)
    # ref_logp is a constant: the gradient is logp's only
    assert torch.autograd.gradcheck(lambda a: kl_penalty(a, rp, kind), (lp,))

    # The straight-through kind with its value shifted (without gradient) to k2's: gradcheck then
    # checks that its first and second derivatives are those of k2.
    def st_as_k2(a):
        shift = (kl_penalty(a, rp, "k2") - kl_penalty(a, rp, kind)).detach()
        return kl_penalty(a, rp, kind + "+") + shift

    assert torch.autograd.gradcheck(st_as_k2, (lp,))
    assert torch.autograd.gradgradcheck(st_as_k2, (lp,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_low_var_kl_gradient_in_and_out_of_saturation(dtype):
    # min(k3, 10): ∂/∂logp = 1 − e^(−d) where k3 < 10 (toward the reference: the sign of d),
    # 0 where k3 > 10 (d < −2.611 or d > 11.000), as verl's clamp. By hand: d = ln 2 gives
    # k3 = ln 2 − 1/2 and 1/2; d = −1 gives e − 2 and 1 − e; d = −3 and d = 12 saturate.
    d = torch.tensor([math.log(2), -1.0, -3.0, 12.0, -30.0, 30.0], dtype=torch.float64)
    ref = torch.full_like(d, -2.0)
    lp = (ref + d).to(dtype).requires_grad_(True)
    out = kl_penalty(lp, ref.to(dtype), "low_var_kl")
    (g,) = torch.autograd.grad(out.sum(), lp)
    want = [math.log(2) - 0.5, math.e - 2, 10, 10, 10, 10]
    torch.testing.assert_close(out.double(), torch.tensor(want, dtype=torch.float64))
    torch.testing.assert_close(
        g.double(), torch.tensor([0.5, 1 - math.e, 0, 0, 0, 0], dtype=torch.float64)
    )
    assert (g.double() * d >= 0).all()  # never directed away from the reference


def test_bad_input_errors_name_the_argument():
    logp, ref = make_logps(torch.float32, 0, 1.0, b=2, t=3)
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logp, ref, "k4")
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logp, ref, "k3++")
    with pytest.raises(ValueError, match="ref_logp"):
        kl_penalty(logp, ref[:, :2], "k3")
    with pytest.raises(TypeError, match="logp"):
        kl_penalty(logp.long(), ref, "k1")
    with pytest.raises(TypeError, match="ref_logp"):
        kl_penalty(logp, ref.long(), "k1")
