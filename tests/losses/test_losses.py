"""Policy/value losses and aggregation against plain per-token references."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from tests._losses_util import (
    DTYPES,
    acc_dtype,
    assert_within_ref_error,
    make_inputs,
    random_mask,
)

from rlops.losses import AGG_MODES, aggregate_loss, policy_loss, value_loss

mpmath.mp.dps = 40


# --------------------------------------------------------------------------- references
def mp(x):
    return mpmath.mpf(float(x))


def ref_token_losses(logp, old, adv, clip_low, clip_high, dual_clip, exact, acc):
    """Per-token PPO loss from the formula, one token at a time."""
    out = torch.zeros(logp.shape, dtype=torch.float64 if exact else acc)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in logp.shape)).tolist():
        idx = tuple(idx)
        if exact:
            d, a = mp(logp[idx]) - mp(old[idx]), mp(adv[idx])
            ratio = mpmath.exp(min(d, 20))
            clipped = min(max(ratio, 1 - mp(clip_low)), 1 + mp(clip_high))
        else:
            d, a = logp[idx].to(acc) - old[idx].to(acc), adv[idx].to(acc)
            ratio = torch.exp(d.clamp_max(20))
            clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
        loss = max(-a * ratio, -a * clipped)
        if dual_clip is not None and a < 0:
            loss = min(loss, -a * dual_clip)
        out[idx] = float(loss) if exact else loss
    return out


def ref_aggregate(loss, mask, mode, scale=None):
    """verl's aggregation modes as loops over rows of ``loss`` (a list of lists of mpf, or a
    ``[B, T]`` tensor whose entries are summed in its dtype)."""
    zero = torch.zeros((), dtype=loss.dtype) if isinstance(loss, torch.Tensor) else mpmath.mpf(0)
    t = len(loss[0])
    rows, total, count = [], zero, 0
    for i, values in enumerate(loss):
        row, n = zero, 0
        for j in range(t):
            if mask[i, j]:
                row, n = row + values[j], n + 1
        total, count = total + row, count + n
        if n:
            rows.append(row / n if mode == "seq-mean-token-mean" else row)
    if mode == "token-mean":
        return total / max(count, 1)
    if mode == "token-sum":
        return total
    out = sum(rows, zero) / max(len(rows), 1)
    return out / (t if scale is None else scale) if mode == "seq-mean-token-sum-norm" else out


def exact_aggregate(loss, mask, mode):
    return torch.tensor(
        float(ref_aggregate([[mp(v) for v in row] for row in loss.tolist()], mask, mode)),
        dtype=torch.float64,
    )


# --------------------------------------------------------------------------- aggregation
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_matches_reference(mode, dtype):
    gen = torch.Generator().manual_seed(3)
    mask = random_mask(7, 31, gen)
    loss = torch.randn(7, 31, generator=gen, dtype=torch.float64).to(dtype)
    loss = torch.where(mask.bool(), loss, torch.inf)  # mask-0 entries must never leak
    acc = acc_dtype(dtype)
    out = aggregate_loss(loss, mask, mode)
    assert out.dtype == acc and out.shape == ()
    exact, scale = exact_aggregate(loss, mask, mode), exact_aggregate(loss.abs(), mask, mode)
    assert_within_ref_error(out, exact, ref_aggregate(loss.to(acc), mask, mode), scale)
    if mode == "seq-mean-token-sum-norm":
        scaled = aggregate_loss(loss, mask, mode, loss_scale_factor=100)
        torch.testing.assert_close(scaled * 100, out * 31)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_of_empty_mask_is_zero(mode):
    loss = torch.randn(3, 4, requires_grad=True)
    out = aggregate_loss(loss, torch.zeros(3, 4), mode)
    assert out == 0
    out.backward()
    assert (loss.grad == 0).all()


# --------------------------------------------------------------------------- policy loss
CLIPS = [(0.2, None, None), (0.2, 0.28, None), (0.1, 0.3, 3.0), (0.2, None, 1.5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("clip_low", "clip_high", "dual_clip"), CLIPS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_matches_reference(clip_low, clip_high, dual_clip, mode, dtype):
    logp, old, adv, mask = make_inputs(dtype, 4, spread=0.5)
    logp = torch.where(mask.bool(), logp, torch.nan)  # mask-0 entries must never leak
    loss, metrics = policy_loss(
        logp, old, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, agg=mode
    )
    acc = acc_dtype(dtype)
    assert loss.dtype == acc and loss.shape == ()
    high = clip_low if clip_high is None else clip_high
    tok_exact = ref_token_losses(logp, old, adv, clip_low, high, dual_clip, True, acc)
    tok_same = ref_token_losses(logp, old, adv, clip_low, high, dual_clip, False, acc)
    exact, scale = (
        exact_aggregate(tok_exact, mask, mode),
        exact_aggregate(tok_exact.abs(), mask, mode),
    )
    assert_within_ref_error(loss, exact, ref_aggregate(tok_same, mask, mode), scale)

    # Metrics: detached 0-dim tensors, counted over action tokens only.
    keep = mask.bool()
    ratio = torch.exp((logp.double() - old.double()).clamp_max(20))
    a = adv.double()
    unclipped, clipped = -a * ratio, -a * ratio.clamp(1 - clip_low, 1 + high)
    n = float(keep.sum())
    frac = float(((clipped > unclipped) & keep).sum()) / n
    lower = (a < 0) & (torch.maximum(unclipped, clipped) > -a * (dual_clip or math.inf)) & keep
    for name, value in metrics.items():
        assert value.shape == () and value.dtype == acc and not value.requires_grad, name
    one_division = {"rtol": torch.finfo(acc).eps, "atol": 0.0}  # count / count, rounded once
    torch.testing.assert_close(
        metrics["pg_clipfrac"], torch.tensor(frac, dtype=acc), **one_division
    )
    lower_frac = torch.tensor(float(lower.sum()) / n, dtype=acc)
    torch.testing.assert_close(metrics["pg_clipfrac_lower"], lower_frac, **one_division)
    kl = old.double() - logp.double()
    assert_within_ref_error(
        metrics["ppo_kl"],
        exact_aggregate(kl, mask, "token-mean"),
        ref_aggregate(old.to(acc) - logp.to(acc), mask, "token-mean"),
        exact_aggregate(kl.abs(), mask, "token-mean"),
    )


@pytest.mark.parametrize("mode", AGG_MODES)
def test_infinite_clip_gives_the_unclipped_surrogate(mode):
    logp, old, adv, mask = make_inputs(torch.float64, 5, spread=1.5)
    loss, metrics = policy_loss(logp, old, adv, mask, clip_low=math.inf, agg=mode)
    surrogate = aggregate_loss(-adv * torch.exp(logp - old), mask, mode)
    assert loss == surrogate and metrics["pg_clipfrac"] == 0


def test_dual_clip_bounds_negative_advantage_tokens():
    gen = torch.Generator().manual_seed(6)
    old = -torch.rand(64, 1, generator=gen, dtype=torch.float64)
    logp = old + torch.cat([torch.rand(32, 1, generator=gen) * 20, torch.full((32, 1), 1e4)])
    adv = -torch.rand(64, 1, generator=gen, dtype=torch.float64) - 0.01
    for c in (1.5, 3.0):
        for i in range(64):  # one token at a time: the loss is that token's loss
            row = slice(i, i + 1)
            loss, m = policy_loss(logp[row], old[row], adv[row], torch.ones(1, 1), dual_clip=c)
            assert loss <= c * -adv[i, 0]
            ratio = math.exp(min(float(logp[i, 0] - old[i, 0]), 20))
            assert (loss == c * -adv[i, 0]) == (ratio > c) == (m["pg_clipfrac_lower"] == 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_policy_and_value_losses_finite_on_extreme_inputs(dtype):
    old = torch.tensor([[0.0, -1e4, -5.0, 0.0], [-1e4, 0.0, -3.0, -3.0]], dtype=dtype)
    logp = torch.tensor([[-1e4, 0.0, -5.0, 0.0], [0.0, -1e4, -3.0, -3.0]], dtype=dtype)
    adv = torch.tensor([[1.0, -1.0, 2.0, 2.0], [-3.0, 3.0, 2.0, 2.0]], dtype=dtype)  # constant tail
    single = torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0]])
    for mask in (torch.ones(2, 4), single):
        for mode in AGG_MODES:
            for dual in (None, 3.0):
                lp = logp.clone().requires_grad_(True)
                loss, metrics = policy_loss(lp, old, adv, mask, dual_clip=dual, agg=mode)
                loss.backward()
                assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
                assert all(torch.isfinite(v) for v in metrics.values())
            v = logp.clone().requires_grad_(True)
            vl, _ = value_loss(v, old, adv, mask, clip=0.2, agg=mode)
            vl.backward()
            assert torch.isfinite(vl) and torch.isfinite(v.grad).all()


def ref_policy_loss_autograd(logp, old, adv, mask, clip_low, clip_high, dual_clip, mode):
    """The same formula written independently with torch ops, for gradient comparison."""
    ratio = torch.exp(torch.clamp(logp - old, max=20))
    loss = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.min(loss, -adv * dual_clip), loss)
    m = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * m).sum() / m.sum()
    return ((loss * m).sum(-1) / m.sum(-1).clamp_min(1))[m.sum(-1) > 0].mean()


@pytest.mark.parametrize(("clip_low", "clip_high", "dual_clip"), CLIPS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_gradients(clip_low, clip_high, dual_clip, mode):
    logp, old, adv, mask = make_inputs(torch.float64, 7, b=5, t=63, spread=0.5)
    high = clip_low if clip_high is None else clip_high
    lp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(
        lp, old, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, agg=mode
    )
    (g,) = torch.autograd.grad(loss, lp)
    lp2 = logp.clone().requires_grad_(True)
    ref = ref_policy_loss_autograd(lp2, old, adv, mask, clip_low, high, dual_clip, mode)
    (g_ref,) = torch.autograd.grad(ref, lp2)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-15)
    assert (g[mask == 0] == 0).all()

    small = tuple(x[:3, :4].clone() for x in (logp, old, adv))
    m = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 1, 1]])

    def f(a):  # old_logp and the advantages are constants: the gradient is logp's only
        kw = {"clip_low": clip_low, "clip_high": clip_high, "dual_clip": dual_clip, "agg": mode}
        return policy_loss(a, small[1], small[2], m, **kw)[0]

    assert torch.autograd.gradcheck(f, (small[0].requires_grad_(True),))


@pytest.mark.parametrize("dtype", DTYPES)
def test_garbage_on_mask_0_tokens_reaches_no_gradient(dtype):
    logp, old, adv, mask = make_inputs(dtype, 10)
    off = mask == 0
    nan = torch.tensor(torch.nan, dtype=dtype)
    logp, old, adv = (torch.where(off, nan, x) for x in (logp, old, adv))
    for mode in AGG_MODES:
        leaves = [x.clone().requires_grad_(True) for x in (logp, old, adv)]
        loss, metrics = policy_loss(*leaves, mask, dual_clip=3.0, agg=mode)
        vloss, vmetrics = value_loss(*leaves, mask, clip=0.2, agg=mode)
        (loss + vloss).backward()
        assert torch.isfinite(loss) and torch.isfinite(vloss)
        assert all(torch.isfinite(v) for v in (*metrics.values(), *vmetrics.values()))
        # the first argument is the live one; the others are constants (no gradient)
        x = leaves[0]
        assert torch.isfinite(x.grad).all() and (x.grad[off] == 0).all()
        assert leaves[1].grad is None and leaves[2].grad is None


# --------------------------------------------------------------------------- value loss
def ref_value_token_losses(v, old, ret, clip):
    err = (v - ret) ** 2
    if clip is None:
        return err
    return torch.maximum(err, (torch.clamp(v, old - clip, old + clip) - ret) ** 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_matches_reference(clip, mode, dtype):
    values, old, ret, mask = make_inputs(dtype, 8, spread=0.5)
    loss, metrics = value_loss(values, old, ret, mask, clip=clip, agg=mode)
    acc = acc_dtype(dtype)
    assert loss.dtype == acc and metrics["vf_clipfrac"].shape == ()
    tok_exact = ref_value_token_losses(values.double(), old.double(), ret.double(), clip)
    exact = 0.5 * exact_aggregate(tok_exact, mask, mode)
    tok_same = ref_value_token_losses(values.to(acc), old.to(acc), ret.to(acc), clip)
    assert_within_ref_error(loss, exact, 0.5 * ref_aggregate(tok_same, mask, mode), exact)
    if clip is None:
        assert metrics["vf_clipfrac"] == 0
    else:
        v, o, r = values.double(), old.double(), ret.double()
        took = ((torch.clamp(v, o - clip, o + clip) - r) ** 2 > (v - r) ** 2) & mask.bool()
        frac = torch.tensor(float(took.sum()) / float(mask.sum()), dtype=acc)
        torch.testing.assert_close(metrics["vf_clipfrac"], frac, rtol=torch.finfo(acc).eps, atol=0)
        assert 0 < metrics["vf_clipfrac"] < 1


@pytest.mark.parametrize("clip", [None, 0.3])
def test_gradcheck_value_loss(clip):
    gen = torch.Generator().manual_seed(9)
    v, old, ret = (torch.randn(3, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    m = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 1, 1]])
    v.requires_grad_(True)
    for mode in AGG_MODES:
        assert torch.autograd.gradcheck(
            lambda x, mode=mode: value_loss(x, old, ret, m, clip=clip, agg=mode)[0], (v,)
        )


# --------------------------------------------------------------------------- bad input
def test_bad_input_errors_name_the_argument():
    lp, old, adv, m = make_inputs(torch.float32, 0, b=2, t=3)
    with pytest.raises(ValueError, match="mode"):
        aggregate_loss(lp, m, "sum")
    with pytest.raises(ValueError, match="agg"):
        policy_loss(lp, old, adv, m, agg="seq-sum")
    with pytest.raises(ValueError, match="agg"):
        value_loss(lp, old, adv, m, agg="sum")
    with pytest.raises(ValueError, match="mask"):
        aggregate_loss(lp, m[:, :2], "token-mean")
    with pytest.raises(ValueError, match="loss_mat"):
        aggregate_loss(lp[0], m[0], "token-mean")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        aggregate_loss(lp, m, "seq-mean-token-sum-norm", loss_scale_factor=0)
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(lp, old.T, adv, m)
    with pytest.raises(TypeError, match="advantages"):
        policy_loss(lp, old, adv.long(), m)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(lp, old, adv, torch.full((2, 3), 0.5))
    for bad in (0.0, -0.2, math.nan):
        with pytest.raises(ValueError, match="clip_low"):
            policy_loss(lp, old, adv, m, clip_low=bad)
        with pytest.raises(ValueError, match="clip_high"):
            policy_loss(lp, old, adv, m, clip_high=bad)
        with pytest.raises(ValueError, match="clip"):
            value_loss(lp, old, adv, m, clip=bad)
    for bad in (1.0, 0.5, -3.0):
        with pytest.raises(ValueError, match="dual_clip"):
            policy_loss(lp, old, adv, m, dual_clip=bad)
    with pytest.raises(TypeError, match="clip_low"):
        policy_loss(lp, old, adv, m, clip_low="0.2")
    with pytest.raises(ValueError, match="returns"):
        value_loss(lp, old, adv[:1], m)
