"""Masked statistics against plain references written from the formulas."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests._losses_util import DTYPES, acc_dtype, assert_within_ref_error, random_mask

from rlops.stats import masked_mean, masked_moments, masked_var, masked_whiten, merge_moments


# --------------------------------------------------------------------------- references
def exact_moments(vals):
    """``(n, mean, M2)`` in exact rational arithmetic, each rounded once to float64."""
    q = [Fraction(float(v)) for v in vals]
    n = len(q)
    mean = sum(q, Fraction(0)) / max(n, 1)
    m2 = sum(((v - mean) ** 2 for v in q), Fraction(0))
    return n, mean, m2


def exact_var(x, mask, unbiased=True):
    n, _, m2 = exact_moments(selected(x, mask))
    return torch.tensor(float(m2 / max(n - (1 if unbiased else 0), 1)), dtype=torch.float64)


def exact_mean(x, mask):
    return torch.tensor(float(exact_moments(selected(x, mask))[1]), dtype=torch.float64)


def exact_whiten(x, mask, eps=1e-8, shift_mean=True):
    n, mean, m2 = exact_moments(selected(x, mask))
    inv = 1 / math.sqrt(float(m2 / max(n - 1, 1) + Fraction(eps)))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for idx in zip(*torch.nonzero(mask, as_tuple=True), strict=True):
        v = float(Fraction(float(x[idx])) - mean) * inv
        out[idx] = v + float(mean) if not shift_mean else v
    return out


def ref_moments(vals, dtype):
    """Serial two-pass loop over the selected values, accumulating in ``dtype``."""
    n = torch.zeros((), dtype=dtype)
    s = torch.zeros((), dtype=dtype)
    for v in vals:
        s, n = s + v.to(dtype), n + 1
    mean = s / max(float(n), 1.0)
    m2 = torch.zeros((), dtype=dtype)
    for v in vals:
        m2 = m2 + (v.to(dtype) - mean) ** 2
    return n, mean, m2


def selected(x, mask):
    return [x[idx] for idx in zip(*torch.nonzero(mask, as_tuple=True), strict=True)]


def ref_var(x, mask, dtype, unbiased=True):
    n, _, m2 = ref_moments(selected(x, mask), dtype)
    return m2 / max(float(n) - (1 if unbiased else 0), 1.0)


def ref_whiten(x, mask, dtype, eps=1e-8, shift_mean=True):
    n, mean, m2 = ref_moments(selected(x, mask), dtype)
    var = m2 / max(float(n) - 1, 1.0)
    out = (x.to(dtype) - mean) / torch.sqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, 0)


# --------------------------------------------------------------------------- values
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_mean_var_whiten_match_reference(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    b, t = 6, 37
    mask = random_mask(b, t, gen)
    x = (torch.randn(b, t, generator=gen, dtype=torch.float64) * 3 + 1.5).to(dtype)
    x = torch.where(mask.bool(), x, torch.nan)  # mask-0 entries must never leak
    acc = acc_dtype(dtype)

    assert_within_ref_error(
        masked_mean(x, mask), exact_mean(x, mask), ref_moments(selected(x, mask), acc)[1].to(dtype)
    )
    rows = masked_mean(x, mask, dim=-1)
    assert rows.shape == (b,) and rows.dtype == dtype and rows[0] == 0
    for i in range(b):
        ref = exact_mean(x[i], mask[i])
        same = ref_moments(selected(x[i], mask[i]), acc)[1].to(dtype)
        assert_within_ref_error(rows[i], ref, same)
    for unbiased in (True, False):
        out = masked_var(x, mask, unbiased=unbiased)
        assert out.dtype == dtype and out >= 0
        assert_within_ref_error(
            out, exact_var(x, mask, unbiased), ref_var(x, mask, acc, unbiased).to(dtype)
        )
    for shift in (True, False):
        out = masked_whiten(x, mask, shift_mean=shift)
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert_within_ref_error(
            out,
            exact_whiten(x, mask, shift_mean=shift),
            ref_whiten(x, mask, acc, shift_mean=shift).to(dtype),
        )


def test_masked_mean_dims_match_torch_mean_on_full_mask():
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    ones = torch.ones_like(x, dtype=torch.bool)
    for dim in (None, 0, -1, (0, 2)):
        expected = x.mean() if dim is None else x.mean(dim=dim)
        torch.testing.assert_close(masked_mean(x, ones, dim), expected, rtol=1e-15, atol=0)


def test_near_constant_data_keeps_variance_accurate():
    # Large offset, tiny spread: E[x²] − E[x]² loses every digit here (and can go negative).
    gen = torch.Generator().manual_seed(3)
    x = (1e4 + 1e-2 * torch.randn(4096, generator=gen, dtype=torch.float64)).float()
    mask = torch.ones_like(x)
    naive = (x * x).mean() - x.mean() ** 2
    exact = exact_var(x, mask)
    assert abs(float(naive) * 4096 / 4095 - float(exact)) > 0.5 * float(exact)  # the trap is real
    assert_within_ref_error(masked_var(x, mask), exact, ref_var(x, mask, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_single_and_empty_selections_are_finite(dtype):
    c = torch.full((2, 5), 0.1, dtype=dtype)
    mask = torch.ones(2, 5)
    for eps in (1e-8, 0.0):
        w = masked_whiten(c, mask, eps=eps)
        assert torch.isfinite(w).all()
        # |x − mean| is a few ulps of c at most; rsqrt(var + eps) ≤ 1/sqrt(eps) or 0 multiplies.
        if eps > 0:
            assert w.double().abs().max() <= 4 * torch.finfo(dtype).eps * 0.1 / math.sqrt(eps)
    assert 0 <= masked_var(c, mask) <= (4 * torch.finfo(dtype).eps * 0.1) ** 2

    one = torch.tensor([[3.0, 7.0, -1.0]], dtype=dtype)
    m1 = torch.tensor([[0, 1, 0]])
    assert masked_mean(one, m1) == 7.0
    assert masked_var(one, m1) == 0 and masked_var(one, m1, unbiased=False) == 0
    assert (masked_whiten(one, m1) == 0).all() and (masked_whiten(one, m1, eps=0.0) == 0).all()

    none = torch.zeros(1, 3)
    assert masked_mean(one, none) == 0 and masked_var(one, none) == 0
    assert (masked_whiten(one, none) == 0).all()
    assert [float(v) for v in masked_moments(one, none)] == [0.0, 0.0, 0.0]


# --------------------------------------------------------------------------- merging shards
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_moments_equals_moments_of_the_union(dtype):
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(8, 50, generator=gen, dtype=torch.float64) * 2 + 7).to(dtype)
    mask = random_mask(8, 50, gen)  # row 0 (an empty shard) contributes nothing
    parts = [masked_moments(x[i], mask[i]) for i in range(8)]
    n, mean, m2 = merge_moments(*(torch.stack(p) for p in zip(*parts, strict=True)))
    n_ref, mean_ref, m2_ref = exact_moments(selected(x, mask))
    _, mean_same, m2_same = ref_moments(selected(x, mask), dtype)
    assert n == n_ref
    assert_within_ref_error(mean, torch.tensor(float(mean_ref), dtype=torch.float64), mean_same)
    assert_within_ref_error(m2, torch.tensor(float(m2_ref), dtype=torch.float64), m2_same)
    empty = merge_moments(torch.zeros(3), torch.zeros(3), torch.zeros(3))
    assert [float(v) for v in empty] == [0.0, 0.0, 0.0]


# --------------------------------------------------------------------------- properties
finite = st.floats(-1e3, 1e3, allow_nan=False, width=64)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(finite, st.booleans()), min_size=1, max_size=40), st.booleans())
def test_masked_var_is_the_variance_of_the_selection(items, unbiased):
    x = torch.tensor([v for v, _ in items], dtype=torch.float64)
    mask = torch.tensor([k for _, k in items])
    sel = x[mask]
    out = masked_var(x, mask, unbiased=unbiased)
    if sel.numel() <= (1 if unbiased else 0):
        assert out == 0
    else:
        scale = float(sel.abs().max()) ** 2  # float64 rounding of the squares, relative to max²
        torch.testing.assert_close(out, sel.var(unbiased=unbiased), rtol=1e-9, atol=1e-9 * scale)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(finite, st.booleans()), min_size=2, max_size=40))
def test_whiten_gives_mean_zero_and_unit_variance(items):
    x = torch.tensor([v for v, _ in items], dtype=torch.float64)
    mask = torch.tensor([k for _, k in items])
    sel = x[mask]
    if sel.numel() < 2 or float(sel.std()) < 1e-3:
        return  # needs two distinct selected values well above eps
    w = masked_whiten(x, mask, eps=0.0)
    assert (w[~mask] == 0).all()
    assert abs(float(w[mask].mean())) < 1e-9
    assert abs(float(w[mask].var()) - 1) < 1e-9


# --------------------------------------------------------------------------- gradients
def test_gradcheck_mean_var_whiten():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]])
    assert torch.autograd.gradcheck(lambda v: masked_mean(v, mask, dim=-1), (x,))
    assert torch.autograd.gradcheck(lambda v: masked_var(v, mask), (x,))
    assert torch.autograd.gradcheck(lambda v: masked_whiten(v, mask), (x,))
    # NaN in a mask-0 entry reaches neither value nor gradient.
    y = x.detach().clone()
    y[1, 2] = torch.nan
    y.requires_grad_(True)
    masked_whiten(y, mask).sum().backward()
    assert torch.isfinite(y.grad).all() and (y.grad[mask == 0] == 0).all()


# --------------------------------------------------------------------------- bad input
def test_bad_input_errors_name_the_argument():
    x, mask = torch.randn(2, 3), torch.ones(2, 3)
    with pytest.raises(TypeError, match="x"):
        masked_mean(torch.ones(2, 3, dtype=torch.long), mask)
    with pytest.raises(ValueError, match="mask"):
        masked_var(x, torch.ones(2, 4))
    with pytest.raises(ValueError, match="mask"):
        masked_whiten(x, torch.full((2, 3), 2))
    with pytest.raises(TypeError, match="mask"):
        masked_mean(x, [[1, 1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="eps"):
        masked_whiten(x, mask, eps=-1e-8)
    with pytest.raises(TypeError, match="eps"):
        masked_whiten(x, mask, eps=True)
    with pytest.raises(TypeError, match="group"):
        masked_whiten(x, mask, group=object())


@pytest.mark.parametrize("magnitude", [1e20, 1e30, 3e38])
def test_huge_finite_float32_values_give_finite_statistics(magnitude):
    """Squares of the data overflow float32; the statistics must not (scaled before squaring)."""
    gen = torch.Generator().manual_seed(11)
    unit = torch.rand(4, 64, generator=gen, dtype=torch.float64) * 2 - 1
    x = (unit * magnitude).float()
    mask = torch.rand(4, 64, generator=gen) > 0.3
    sel = x.double()[mask]
    white = masked_whiten(x, mask)
    assert torch.isfinite(white).all()
    expected = torch.where(mask, (x.double() - sel.mean()) / sel.std(), 0.0)
    torch.testing.assert_close(white.double(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(masked_mean(x, mask).double(), sel.mean(), rtol=1e-5, atol=0)
    var = masked_var(x, mask)
    true_var = float(sel.var())
    if true_var < torch.finfo(torch.float32).max:
        assert abs(float(var) / true_var - 1) < 1e-5
    else:  # not representable: overflow to inf, never NaN
        assert var == torch.inf
