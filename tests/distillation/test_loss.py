"""``distillation_loss`` against its float64 definition, written plainly from the formulas
(``rlops.distillation.reference``): values and gradients of every kind × tail × clamp ×
temperature, top-k and full teacher, ``[N, V]`` and ``[B, T, V]``; gradcheck; the metrics."""

from __future__ import annotations

import itertools

import pytest
import torch
from tests.distillation._util import KINDS, logits, teacher
from tests.tolerances import assert_error_within, max_abs_err

from rlops import distillation_loss
from rlops.distillation import _engine
from rlops.distillation.reference import distillation_reference

# (kind, tail, clamp, temperature, top-k)
GRID = [
    c
    for c in itertools.product(KINDS, (False, True), (None, -4.0), (1.0, 0.7), (True, False))
    if not (c[1] and not c[4])  # a full teacher has no tail
]


def _run(fn, z, a, ids, w, **kw):
    z = z.detach().clone().requires_grad_()
    out = fn(z, a, ids, **kw)
    loss, metrics = out if isinstance(out, tuple) else (out, None)
    (loss * w.to(loss.dtype)).sum().backward()
    return loss.detach(), z.grad, metrics


def _check(z64, a64, ids, kw, name):
    """float32 fast vs float64 definition within the rule: twice the float32 reference's
    error plus a few ulps; float64 fast within a few float64 ulps of the definition."""
    w = torch.randn(z64.shape[:-1], dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    exact, gexact, _ = _run(distillation_reference, z64, a64, ids, w, **kw)
    exact_m = (exact, gexact)
    ref32 = _run(distillation_reference, z64.float(), a64.float(), ids, w, **kw)[:2]
    fast32 = _run(distillation_loss, z64.float(), a64.float(), ids, w, **kw)[:2]
    fast64 = _run(distillation_loss, z64, a64, ids, w, **kw)[:2]
    errs = []
    scale = torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps
    outs = zip(("loss", "grad"), fast32, ref32, fast64, exact_m, strict=True)
    for what, f32, r32, f64, ex in outs:
        assert f32.dtype == torch.float32 and f32.shape == ex.shape
        # the loss sums terms p·log p of magnitude up to 1 (it may cancel to 0: jsd at β = 1)
        # the gradient's terms p·(log p_s − log p_t + 1) carry the log-probs' roundings
        top = float(ex.abs().max()) if ex.numel() else 0.0
        mag = max(top, 1.0) if what == "loss" else top * (1 + float(a64.abs().max()))
        factor = 2.0 if what == "loss" else 3.0  # gradients: two roundings of p (the rule)
        err, ref_err = max_abs_err(f32, ex), max_abs_err(r32, ex)
        assert_error_within(f"{name} {what}", err, ref_err, torch.float32, mag, factor)
        # float64: the float32 reference's error at float64's unit roundoff
        err64 = max_abs_err(f64, ex)
        assert_error_within(
            f"{name} {what} f64", err64, ref_err * scale, torch.float64, mag, factor
        )
        errs.append(err)
    return errs


@pytest.mark.parametrize(("kind", "tail", "clamp", "tau", "topk"), GRID)
@pytest.mark.parametrize("shape", [(37, 50), (3, 13, 29)])
def test_matches_definition(kind, tail, clamp, tau, topk, shape):
    z = logits(shape)
    a, ids = teacher(shape, 7 if topk else None)
    kw = dict(kind=kind, tail=tail, log_prob_min_clamp=clamp, temperature=tau, beta=0.3)
    _check(z, a, ids, kw, f"{kind} tail={tail} clamp={clamp} tau={tau} topk={topk}")


@pytest.mark.parametrize("n", [1, 127, 128, 129, 1000])
@pytest.mark.parametrize("kind", KINDS)
def test_odd_sizes_and_many_chunks(n, kind, monkeypatch):
    monkeypatch.setattr(_engine, "CHUNK_ELEMENTS", 64 * 31)  # chunks of 31 rows of V = 64
    z = logits((n, 64), seed=n)
    a, ids = teacher((n, 64), 5, seed=n)
    _check(z, a, ids, dict(kind=kind, tail=True), f"{kind} n={n}")
    a, _ = teacher((n, 64), None, seed=n)
    _check(z, a, None, dict(kind=kind), f"{kind} full n={n}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("offset", [0.0, 150.0])
def test_full_teacher_large_and_spread_logits(kind, offset):
    """A full teacher's forward and reverse KL are sums split at the shard's own max, with the
    log-normaliser added after: within the rule where logits are large (offset) and spread
    (log-probs down to about −100) and the teacher is sharp."""
    z = logits((40, 300), seed=5, scale=12.0) + offset
    a, _ = teacher((40, 300), None, seed=6, scale=8.0)
    _check(z, a, None, dict(kind=kind, temperature=0.9), f"{kind} offset={offset}")


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_jsd_ends(beta):
    z = logits((9, 20))
    a, ids = teacher((9, 20), 4)
    _check(z, a, ids, dict(kind="jsd", tail=True, beta=beta), f"jsd beta={beta}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_computed_in_float32(dtype):
    z = logits((40, 33)).to(dtype)
    a, ids = teacher((40, 33), 6)
    loss, _metrics = distillation_loss(z, a.float(), ids, tail=True, kind="reverse_kl")
    assert loss.dtype == torch.float32
    exact = distillation_reference(z.double(), a, ids, tail=True, kind="reverse_kl")
    ref32 = distillation_reference(z.float(), a.float(), ids, tail=True, kind="reverse_kl")
    mag = float(exact.abs().max())
    assert_error_within(
        "half", max_abs_err(loss, exact), max_abs_err(ref32, exact), torch.float32, mag
    )


def test_k_equal_to_vocabulary_tail_is_empty():
    """With every id in the top-k the tail bucket holds nothing: tail=True is the full KL."""
    z = logits((5, 8))
    a, ids = teacher((5, 8), 8)
    full = distillation_reference(
        z, torch.log_softmax(torch.zeros(5, 8, dtype=torch.float64), -1).scatter(-1, ids, a)
    )
    loss, _ = distillation_loss(z, a, ids, tail=True)
    torch.testing.assert_close(loss, full, rtol=0, atol=1e-13)


def test_tail_accurate_where_one_minus_sum_is_not():
    """A student whose top-k holds all but ~1e-9 of its mass: the tail is its own sum in the
    fast path, exact to float32's relative precision, where ``1 − Σ`` in float32 is noise."""
    z = torch.zeros(4, 100, dtype=torch.float64)
    ids = torch.arange(8).expand(4, 8).contiguous()
    z[:, :8] = 25.0 + torch.arange(4, dtype=torch.float64)[:, None]
    a = torch.log(torch.full((4, 8), 0.1, dtype=torch.float64))  # teacher tail 0.2
    exact = distillation_reference(z, a, ids, tail=True)
    ref32 = distillation_reference(z.float(), a.float(), ids, tail=True)
    fast32, _ = distillation_loss(z.float(), a.float(), ids, tail=True)
    assert max_abs_err(fast32, exact) < 1e-5 * float(exact.abs().max())
    assert not torch.isfinite(ref32).all() or max_abs_err(ref32, exact) > 1e-3


def test_clamp_is_clamp_min():
    """Below the clamp the student's log-prob gets no gradient; the masses are unclamped."""
    z = torch.tensor([[10.0, 0.0, -20.0, 0.0]], dtype=torch.float64, requires_grad=True)
    a = torch.log(torch.tensor([[0.5, 0.3]], dtype=torch.float64))
    ids = torch.tensor([[0, 2]])
    loss, m = distillation_loss(z, a, ids, log_prob_min_clamp=-5.0)
    logp = torch.log_softmax(z.detach(), -1)
    assert torch.allclose(m["student_mass"], logp[:, [0, 2]].exp().sum(-1))
    expected = (a.exp() * (a - logp[:, [0, 2]].clamp_min(-5.0))).sum(-1)
    torch.testing.assert_close(loss.detach(), expected)
    loss.sum().backward()
    expected_grad = -0.5 * (torch.tensor([[1.0, 0, 0, 0]]) - logp.exp())
    torch.testing.assert_close(z.grad, expected_grad.double())


@pytest.mark.parametrize(
    ("kind", "tail", "topk"),
    [(k, t, p) for k in KINDS for t, p in ((False, False), (False, True), (True, True))],
)
def test_gradcheck(kind, tail, topk):
    z = logits((3, 6), scale=1.0).requires_grad_()
    a, ids = teacher((3, 6), 2 if topk else None)

    def fn(z):
        return distillation_loss(
            z, a, ids, kind=kind, tail=tail, temperature=0.8, log_prob_min_clamp=-6.0, beta=0.4
        )[0]

    assert torch.autograd.gradcheck(fn, (z,))


def test_metrics():
    """student_mass, teacher_mass; verl's overlap diagnostics from their definitions."""
    z = logits((6, 7, 30))
    a, ids = teacher((6, 7, 30), 5)
    _loss, m = distillation_loss(z, a, ids, log_prob_min_clamp=-3.0)
    logp = torch.log_softmax(z, -1)
    s = logp.gather(-1, ids)
    torch.testing.assert_close(m["student_mass"], s.exp().sum(-1))
    torch.testing.assert_close(m["teacher_mass"], a.exp().sum(-1))
    top = z.topk(5, -1).indices
    over = (ids[..., :, None] == top[..., None, :]).any(-1)
    assert torch.equal(m["overlap_count"], over.sum(-1))
    ac, sc = a.clamp_min(-3.0), s.clamp_min(-3.0)
    adv = (-(ac.exp() * (ac - sc)) * over).sum(-1) / over.sum(-1).clamp_min(1)
    torch.testing.assert_close(
        m["overlap_token_advantage"], torch.where(over.sum(-1) > 0, adv, 0.0)
    )
    assert all(v.shape == (6, 7) and not v.requires_grad for v in m.values())
    full = distillation_loss(z, logp, None)[1]
    assert set(full) == {"student_mass", "teacher_mass"}


@pytest.mark.parametrize(
    ("v", "k"), [(1, 1), (15, 1), (16, 1), (17, 1), (129, 7), (1000, 7), (4099, 64), (20000, 16)]
)
@pytest.mark.parametrize("ties", [False, True])
def test_student_top_values_are_topk(v, k, ties):
    """The student's k largest logits, searched through block maxima, are ``topk``'s values
    exactly (as a multiset): with ties, −inf, a row of −inf and columns left over."""
    x = logits((6, v), seed=v)
    if ties:
        x = x.round()
    x[0, ::3] = -torch.inf
    x[1] = -torch.inf
    got = _engine.top_values(x, k).sort(1, descending=True).values
    assert torch.equal(got, x.topk(k, 1).values)


def test_overlap_with_ties_on_a_wide_vocabulary():
    """``overlap_count`` from its definition (teacher ids whose logit is at least the student's
    k-th largest: ties count) where the top-k search goes through block maxima."""
    z = logits((3, 50, 700)).round()
    a, ids = teacher((3, 50, 700), 9)
    _, m = distillation_loss(z, a, ids)
    theta = z.topk(9, -1).values[..., -1:]
    assert torch.equal(m["overlap_count"], (z.gather(-1, ids) >= theta).sum(-1))


@pytest.mark.parametrize("v", [11, 1000])  # 1000: the top-k search through block maxima
def test_empty_rows(v):
    z = torch.zeros(0, v, requires_grad=True)
    loss, _m = distillation_loss(
        z, torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.int64), tail=True
    )
    loss.sum().backward()
    assert loss.shape == (0,) and z.grad.shape == (0, v)


def test_teacher_is_a_constant():
    z = logits((4, 9))
    a, ids = teacher((4, 9), 3)
    a = a.requires_grad_()
    loss, _ = distillation_loss(z.requires_grad_(), a, ids)
    loss.sum().backward()
    assert a.grad is None


def test_every_buffer_written(monkeypatch):
    """``empty`` buffers filled with NaN: a row or column left unwritten would show."""
    empty_like, new_empty = torch.empty_like, torch.Tensor.new_empty

    def nan(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan(empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda *a, **k: nan(new_empty(*a, **k)))
    monkeypatch.setattr(_engine, "CHUNK_ELEMENTS", 40 * 7)
    z = logits((30, 40))
    for k, tail in ((5, True), (5, False), (None, False)):
        a, ids = teacher((30, 40), k)
        zz = z.clone().requires_grad_()
        loss, m = distillation_loss(zz, a, ids, tail=tail, kind="jsd")
        loss.sum().backward()
        assert torch.isfinite(loss).all() and torch.isfinite(zz.grad).all()
        assert all(torch.isfinite(v.double()).all() for v in m.values())


@pytest.mark.parametrize("kind", KINDS)
def test_teacher_zeros_and_masked_logits(kind):
    """Teacher log-probs of −inf (probability 0) and student logits of −inf (a masked id
    outside the top-k) follow the definition's limits (``0·log 0 = 0``)."""
    z = logits((6, 12))
    a, ids = teacher((6, 12), 4)
    outside = torch.ones(6, 12).scatter_(-1, ids, 0.0).argmax(-1, keepdim=True)
    z.scatter_(-1, outside, -torch.inf)  # one masked id per row, outside the top-k
    a = a.clone()
    a[:, 0] = -torch.inf
    zz = z.clone().requires_grad_()
    loss, _ = distillation_loss(zz, a, ids, kind=kind, tail=True)
    loss.sum().backward()
    logp = torch.log_softmax(z, -1)
    p_t, p_s = a.exp(), logp.exp().gather(-1, ids)
    p_t = torch.cat([p_t, 1 - p_t.sum(-1, keepdim=True)], -1)
    p_s = torch.cat([p_s, 1 - p_s.sum(-1, keepdim=True)], -1)
    if kind == "reverse_kl":  # the student has mass where the teacher has none: infinite
        assert (loss == torch.inf).all()
        return
    if kind == "forward_kl":
        expected = (torch.xlogy(p_t, p_t) - torch.xlogy(p_t, p_s)).sum(-1)
    else:
        m = (p_t + p_s) / 2
        expected = 0.5 * (torch.xlogy(p_t, p_t / m) + torch.xlogy(p_s, p_s / m)).sum(-1)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(zz.grad).all() and (zz.grad[z == -torch.inf] == 0).all()
