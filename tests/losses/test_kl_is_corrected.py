"""The importance-sampling corrected KL estimate ``kl_penalty(..., old_logp=)`` (DeepSeek-V3.2,
https://arxiv.org/abs/2512.02556 §3.1) against its formula written plainly, hand-computed
values, its analytic gradient, and exact expectations over a small vocabulary."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from tests._losses_util import DTYPES, acc_dtype, assert_within_ref_error

from rlops.losses import kl_penalty

mpmath.mp.dps = 40
BASE_KINDS = ["k1", "abs", "k2", "k3", "low_var_kl"]
LN2 = math.log(2.0)


def make_logps(dtype, seed, spread, b=6, t=29):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    logp = old + spread * torch.randn(b, t, generator=gen, dtype=torch.float64)
    ref = old + spread * torch.randn(b, t, generator=gen, dtype=torch.float64)
    return logp.to(dtype), ref.to(dtype), old.to(dtype)


def plain_kind(d, kind):
    """One token's estimate from ``d = log π − log π_ref`` (an mpf), as Schulman's blog."""
    k3 = mpmath.exp(-max(d, -20)) - 1 + max(d, -20)
    return {"k1": d, "abs": abs(d), "k2": d * d / 2, "k3": k3, "low_var_kl": min(k3, 10)}[kind]


def plain_corrected(logp, ref, old, kind):
    """(π/π_old)·k(d) token by token in 40-digit arithmetic, the ratio's exponent ≤ 20;
    low_var_kl clamps the product: min(r·k3, 10) (NeMo-RL's and slime's form)."""
    out = torch.zeros(logp.shape, dtype=torch.float64)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in logp.shape)).tolist():
        idx = tuple(idx)
        lp, rp, op = (mpmath.mpf(float(x[idx])) for x in (logp, ref, old))
        r = mpmath.exp(min(lp - op, 20))
        if kind == "low_var_kl":
            out[idx] = float(min(r * plain_kind(lp - rp, "k3"), 10))
        else:
            out[idx] = float(r * plain_kind(lp - rp, kind))
    return out


def same_dtype_corrected(logp, ref, old, kind, acc):
    """The formula in the accumulation dtype, k3 as verl writes it (exp(−d) − 1 + d)."""
    lp, rp, op = (x.to(acc) for x in (logp, ref, old))
    d = lp - rp
    k3 = torch.exp(-d.clamp_min(-20)) - 1 + d.clamp_min(-20)
    r = torch.exp((lp - op).clamp_max(20))
    if kind == "low_var_kl":
        return (r * k3).clamp_max(10)
    return r * {"k1": d, "abs": d.abs(), "k2": 0.5 * d * d, "k3": k3}[kind]


# --------------------------------------------------------------------------- values
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", BASE_KINDS)
def test_value_matches_the_formula(kind, dtype):
    logp, ref, old = make_logps(dtype, 0, spread=1.5)
    out = kl_penalty(logp, ref, kind, old_logp=old)
    assert out.dtype == dtype and out.shape == logp.shape
    exact = plain_corrected(logp, ref, old, kind)
    same = same_dtype_corrected(logp, ref, old, kind, acc_dtype(dtype)).to(dtype)
    assert_within_ref_error(out, exact, same)


def _hand_case():
    """2×3 tokens with (log r, d) chosen so that r ∈ {1, 2, 1/2} and e^(−d) ∈ {1, 2, 1/2, 1/e}."""
    lr = torch.tensor([[0.0, LN2, -LN2], [LN2, -LN2, 0.0]], dtype=torch.float64)
    d = torch.tensor([[0.0, LN2, -LN2], [-LN2, LN2, 1.0]], dtype=torch.float64)
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], dtype=torch.float64)
    return logp, logp - d, logp - lr


def test_hand_computed_values_and_gradients():
    logp, ref, old = _hand_case()
    lp, rp, op = (x.clone().requires_grad_(True) for x in (logp, ref, old))
    out = kl_penalty(lp, rp, "k3", old_logp=op)
    # r·(e^(−d) − 1 + d): 1·0; 2·(ln2 − 1/2); (1/2)·(1 − ln2); 2·(1 − ln2); (1/2)·(ln2 − 1/2); e^-1
    value = [[0.0, 2 * LN2 - 1, 0.5 * (1 - LN2)], [2 * (1 - LN2), 0.5 * (LN2 - 0.5), 1 / math.e]]
    torch.testing.assert_close(out, torch.tensor(value, dtype=torch.float64), rtol=1e-14, atol=0)
    g_lp, g_rp, g_op = torch.autograd.grad(out.sum(), (lp, rp, op), allow_unused=True)
    # ∂/∂logp = r·d; ref_logp and old_logp are constants: no gradient
    want_lp = [[0.0, 2 * LN2, -0.5 * LN2], [-2 * LN2, 0.5 * LN2, 1.0]]
    f64 = torch.float64
    torch.testing.assert_close(g_lp, torch.tensor(want_lp, dtype=f64), rtol=1e-14, atol=1e-16)
    assert g_rp is None and g_op is None


# --------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("kind", BASE_KINDS)
def test_gradcheck_and_gradgradcheck(kind):
    gen = torch.Generator().manual_seed(3)
    lp = -torch.rand(2, 3, generator=gen, dtype=torch.float64) - 0.5
    rp = lp + 0.8 * torch.randn(2, 3, generator=gen, dtype=torch.float64)
    op = lp + 0.5 * torch.randn(2, 3, generator=gen, dtype=torch.float64)
    inputs = (lp.clone().requires_grad_(True),)

    def fn(a):  # ref_logp and old_logp are constants: the gradient is logp's only
        return kl_penalty(a, rp, kind, old_logp=op)

    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_k3_gradient_is_the_formulas_even_where_the_value_saturates(dtype):
    # Log-ratios of ±50: r and e^(−d) have their exponents clamped at 20, but ∂/∂logp stays r·d.
    vals = torch.tensor([-50.0, -19.0, -3.0, 0.0, 0.7, 50.0], dtype=torch.float64)
    lr, d = (x.flatten() for x in torch.meshgrid(vals, vals, indexing="ij"))
    logp = torch.full_like(lr, -2.0)
    ref, old = logp - d, logp - lr
    lp = logp.to(dtype).requires_grad_(True)
    out = kl_penalty(lp, ref.to(dtype), "k3", old_logp=old.to(dtype))
    (g_lp,) = torch.autograd.grad(out.sum(), lp)
    r = torch.exp(lr.clamp_max(20))
    k3 = torch.expm1(-d.clamp_min(-20)) + d.clamp_min(-20)
    eps = torch.finfo(dtype).eps
    for got, want in ((out, r * k3), (g_lp, r * d)):
        assert torch.isfinite(got).all()
        assert ((got.double() - want).abs() <= 4 * eps * want.abs()).all()
    assert (out >= 0).all()


def test_float32_gradient_avoids_the_chain_rules_cancellation():
    # ∂(r·k3)/∂logp by the chain rule is r·k3 + r·(1 − e^(−d)): two terms of size r·e^(−d).
    d = -torch.linspace(8, 19, 45, dtype=torch.float64)
    lr = torch.full_like(d, 0.3)
    logp = torch.full_like(d, -1.0)
    lp = logp.float().requires_grad_(True)
    ref, old = (logp - d).float(), (logp - lr).float()
    (g,) = torch.autograd.grad(kl_penalty(lp, ref, "k3", old_logp=old).sum(), lp)
    want = torch.exp(lr) * d
    bound = 4 * torch.finfo(torch.float32).eps * want.abs()
    assert ((g.double() - want).abs() <= bound).all()
    lp2 = logp.float().requires_grad_(True)
    chain = torch.exp(lp2 - old) * kl_penalty(lp2, ref, "k3")
    (g2,) = torch.autograd.grad(chain.sum(), lp2)
    assert ((g2.double() - want).abs() > bound).any()  # the trap this avoids


def test_identity_with_old_logp_equal_to_logp():
    # r = exp(0) = 1 exactly: the value is the kind's own; k3's gradient is r·d = d, which is
    # the gradient of k2 and of the straight-through "k3+".
    logp, ref, _ = make_logps(torch.float64, 4, spread=3.0)
    for kind in BASE_KINDS:
        lp = logp.clone().requires_grad_(True)
        out = kl_penalty(lp, ref, kind, old_logp=lp.detach())
        assert torch.equal(out.detach(), kl_penalty(logp, ref, kind))
    lp = logp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(kl_penalty(lp, ref, "k3", old_logp=lp.detach()).sum(), lp)
    (g_st,) = torch.autograd.grad(kl_penalty(lp, ref, "k3+").sum(), lp)
    assert torch.equal(g, logp - ref) and torch.equal(g, g_st)
    # k1: ∂(r·d)/∂logp = r·d + r = d + 1
    (g1,) = torch.autograd.grad(kl_penalty(lp, ref, "k1", old_logp=lp.detach()).sum(), lp)
    torch.testing.assert_close(g1, logp - ref + 1, rtol=0, atol=4e-16)


# --------------------------------------------------------------------------- low_var_kl
def test_low_var_kl_hand_computed_values_and_gradients_in_and_out_of_saturation():
    # (d, r): k3(−3) = e³ − 4 = 16.0855..., k3(12) = e^−12 + 11, k3(ln2) = ln2 − 1/2,
    # k3(−2) = e² − 3 = 4.389...
    d = torch.tensor([-3.0, -3.0, 12.0, 12.0, LN2, -2.0], dtype=torch.float64)
    lr = torch.tensor([-LN2, 0.0, 0.0, -LN2, LN2, 1.0], dtype=torch.float64)
    logp = torch.full_like(d, -1.5)
    lp = logp.clone().requires_grad_(True)
    out = kl_penalty(lp, logp - d, "low_var_kl", old_logp=logp - lr)
    (g,) = torch.autograd.grad(out.sum(), lp)
    e = math.e
    value = [
        0.5 * (e**3 - 4),  # k3 > 10, r·k3 = 8.04 < 10: not saturated (r·min(k3, 10) gave 5)
        10.0,  # r·k3 = 16.09: saturated
        10.0,  # d > 11: saturated on the other side
        0.5 * (math.exp(-12) + 11),  # 5.5: not saturated
        2 * (LN2 - 0.5),  # k3 < 10, r·k3 < 10
        10.0,  # k3 = 4.39 < 10 but r·k3 = e·4.39 = 11.93: saturated (r·min(k3, 10) = 11.93)
    ]
    grad = [-1.5, 0.0, 0.0, 6.0, 2 * LN2, 0.0]  # r·d where r·k3 < 10, else 0
    torch.testing.assert_close(out, torch.tensor(value, dtype=torch.float64), rtol=1e-14, atol=0)
    torch.testing.assert_close(g, torch.tensor(grad, dtype=torch.float64), rtol=1e-14, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_low_var_kl_gradient_never_points_away_from_the_reference(dtype):
    # Every (d, log r) pair on a grid reaching deep into saturation on both sides (k3 > 10 for
    # d < −2.611 or d > 11.000): a gradient-descent step moves logp toward ref_logp or not at
    # all, i.e. grad·d ≥ 0, and |d| does not grow.
    d_vals = torch.linspace(-30, 30, 121, dtype=torch.float64)
    lr_vals = torch.linspace(-25, 25, 101, dtype=torch.float64)
    d, lr = (x.flatten() for x in torch.meshgrid(d_vals, lr_vals, indexing="ij"))
    logp = torch.full_like(d, -35.0)
    ref, old = (logp - d).to(dtype), (logp - lr).to(dtype)
    lp = logp.to(dtype).requires_grad_(True)
    out = kl_penalty(lp, ref, "low_var_kl", old_logp=old)
    (g,) = torch.autograd.grad(out.sum(), lp)
    dist = (lp.detach() - ref).double().abs()
    assert ((g.double() * (lp.detach() - ref).double()) >= 0).all()
    eta = 1e-9  # η·r ≤ 2 for every r ≤ e^20
    stepped = (lp.detach().double() - eta * g.double() - ref.double()).abs()
    assert (stepped <= dist).all()
    k3 = torch.expm1(-d.clamp_min(-20)) + d.clamp_min(-20)
    r = torch.exp(lr.clamp_max(20))
    sat = r * k3 > 10 * (1 + 1e-5)
    assert sat.sum() > 1000 and g[sat].eq(0).all()  # the saturated branch is a constant
    # The factor-clamped form r·min(k3, 10) has gradient 10·r > 0 in saturation: where d < 0
    # (π ≪ π_ref), descent lowers logp further from the reference.
    lp2 = logp.to(dtype).requires_grad_(True)
    r2 = torch.exp((lp2 - old).clamp_max(20))
    (g_factor,) = torch.autograd.grad((r2 * kl_penalty(lp2, ref, "low_var_kl")).sum(), lp2)
    assert ((g_factor.double() * (lp2.detach() - ref).double()) < 0).sum() > 1000


@pytest.mark.parametrize("dtype", DTYPES)
def test_low_var_kl_unchanged_where_the_clamp_is_inactive(dtype):
    # Where r·k3 ≤ 10 (and k3 ≤ 10), the value is bit for bit the corrected k3's and that of the
    # form before, r·min(k3, 10), as rlops computed it: r = exp(min(lp − op, 20)), k3 in the
    # expm1 form, in the accumulation dtype, then cast. Gradients there are the corrected k3's.
    logp, ref, old = make_logps(dtype, 7, spread=2.5, b=8, t=129)
    lp = logp.clone().requires_grad_(True)
    out = kl_penalty(lp, ref, "low_var_kl", old_logp=old)
    k3 = kl_penalty(lp, ref, "k3", old_logp=old)
    acc = acc_dtype(dtype)
    lp_, rp_, op_ = (x.to(acc) for x in (logp, ref, old))
    dc = (lp_ - rp_).clamp_min(-20)
    plain_k3 = (torch.expm1(-dc) + dc).clamp_min(0)
    before = (torch.exp((lp_ - op_).clamp_max(20)) * plain_k3.clamp_max(10)).to(dtype)
    # (9.9: below 10 also before the cast to a half dtype rounds r·k3)
    inactive = (k3.detach().double() < 9.9) & (plain_k3 <= 10)
    assert 0 < inactive.sum() < inactive.numel()
    assert torch.equal(out.detach()[inactive], before[inactive])
    assert torch.equal(out.detach()[inactive], k3.detach()[inactive])
    (g,) = torch.autograd.grad(out.float().sum(), lp, retain_graph=True)
    (g_k3,) = torch.autograd.grad(k3.float().sum(), lp)
    assert torch.equal(g[inactive], g_k3[inactive])
    assert g[~inactive & (k3.detach().double() > 10)].eq(0).all()


# --------------------------------------------------------------------------- unbiasedness
def test_expectation_over_old_policy_is_kl_and_its_gradient():
    # Exact expectations over a 7-token vocabulary (a sum, not a sample): with y ~ π_old,
    # E[r·k3] = KL(π_θ‖π_ref) and E[∇_θ(r·k3)] = ∇_θ KL; with the ratio detached, the gradient
    # is that of KL(π_ref‖π_θ) instead.
    gen = torch.Generator().manual_seed(5)
    theta = torch.randn(7, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), 0)
    old = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), 0)
    p_old = old.exp()

    def logp():
        return torch.log_softmax(theta, 0)

    lp = logp().detach()
    kl = sum(math.exp(lp[y].item()) * (lp[y].item() - ref[y].item()) for y in range(7))
    (g_kl,) = torch.autograd.grad((logp().exp() * (logp() - ref)).sum(), theta)
    for kind in ("k1", "k3"):
        est = (p_old * kl_penalty(logp(), ref, kind, old_logp=old)).sum()
        (g,) = torch.autograd.grad(est, theta)
        assert est.item() == pytest.approx(kl, rel=1e-12)
        torch.testing.assert_close(g, g_kl, rtol=1e-12, atol=1e-14)

    ratio = torch.exp(lp - old)
    detached = (p_old * ratio * kl_penalty(logp(), ref, "k3")).sum()
    (g_det,) = torch.autograd.grad(detached, theta)
    (g_fwd,) = torch.autograd.grad(-(ref.exp() * logp()).sum(), theta)  # ∇ KL(π_ref‖π_θ)
    torch.testing.assert_close(g_det, g_fwd, rtol=1e-12, atol=1e-14)
    assert (g_det - g_kl).abs().max() > 1e-3


# --------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("kind", BASE_KINDS)
def test_log_ratios_of_50_are_finite(kind, dtype):
    vals = torch.tensor([-50.0, 0.0, 50.0], dtype=torch.float64)
    lr, d = (x.flatten() for x in torch.meshgrid(vals, vals, indexing="ij"))
    logp = torch.full_like(lr, -60.0)
    lp, rp, op = (x.to(dtype).requires_grad_(True) for x in (logp, logp - d, logp - lr))
    out = kl_penalty(lp, rp, kind, old_logp=op)
    assert torch.isfinite(out).all()
    (grad,) = torch.autograd.grad(out.float().sum(), lp)
    if dtype != torch.float16:  # float16 cannot hold a gradient of r = e^20 (max 65504)
        assert torch.isfinite(grad).all()
    if kind in ("k3", "low_var_kl", "abs", "k2"):
        assert (out >= 0).all()


def test_no_gradient_needed_and_half_inputs():
    logp, ref, old = make_logps(torch.bfloat16, 6, spread=1.0, b=2, t=5)
    out = kl_penalty(logp, ref, "k3", old_logp=old)
    assert out.dtype == torch.bfloat16 and out.grad_fn is None


def test_bad_input_errors_name_the_argument():
    logp, ref, old = make_logps(torch.float32, 0, 1.0, b=2, t=3)
    with pytest.raises(ValueError, match="old_logp"):
        kl_penalty(logp, ref, "k3", old_logp=old[:, :2])
    with pytest.raises(TypeError, match="old_logp"):
        kl_penalty(logp, ref, "k3", old_logp=old.long())
    with pytest.raises(TypeError, match="old_logp"):
        kl_penalty(logp, ref, "k3", old_logp=old.tolist())
    for kind in ("k3+", "low_var_kl+", "kl+"):
        with pytest.raises(ValueError, match="old_logp"):
            kl_penalty(logp, ref, kind, old_logp=old)
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logp, ref, "k4", old_logp=old)
