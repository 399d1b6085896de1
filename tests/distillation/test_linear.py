"""``linear_distillation_loss`` equals ``distillation_loss`` on ``hidden @ weightᵀ + bias``:
values, metrics, and the gradients of hidden, weight and bias, chunked or not."""

from __future__ import annotations

import pytest
import torch
from tests.distillation._util import KINDS, teacher
from tests.tolerances import assert_error_within, max_abs_err

from rlops import distillation_loss, linear_distillation_loss
from rlops.distillation import _engine
from rlops.distillation.reference import distillation_reference


def _head(n_shape, v, h, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*n_shape, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5 * 2
    bias = torch.randn(v, generator=g, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype)


def _grads(fn, leaves, w_out):
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    loss, metrics = fn(*leaves)
    (loss * w_out.to(loss.dtype)).sum().backward()
    return [loss.detach(), *(x.grad for x in leaves)], metrics


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("topk", "tail"), [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("shape", [(45,), (3, 11)])
def test_equals_the_op_on_logits(kind, topk, tail, shape, monkeypatch):
    monkeypatch.setattr(_engine, "CHUNK_ELEMENTS", 40 * 7)  # chunks of 7 rows
    v = 40
    hidden, weight, bias = _head(shape, v, 6)
    a, ids = teacher((*shape, v), 5 if topk else None)
    kw = dict(kind=kind, tail=tail, temperature=0.9, log_prob_min_clamp=-5.0)
    w_out = torch.randn(shape, dtype=torch.float64)

    def linear(h, w, b):
        return linear_distillation_loss(h, w, a, ids, bias=b, **kw)

    def logits_op(h, w, b):
        return distillation_loss(h @ w.T + b, a, ids, **kw)

    got, m1 = _grads(linear, [hidden, weight, bias], w_out)
    want, m2 = _grads(logits_op, [hidden, weight, bias], w_out)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    assert m1.keys() == m2.keys()
    for k in m1:
        torch.testing.assert_close(m1[k], m2[k], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_float32_within_the_rule(kind):
    """float32 linear op vs the float64 definition: at most twice the float32 unfused
    reference's error (``h @ W.T + b``, then the plain definition) plus a few ulps."""
    hidden, weight, bias = _head((129,), 77, 16, seed=2)
    a, ids = teacher((129, 77), 9, seed=2)
    w_out = torch.randn(129, dtype=torch.float64)

    def ref(h, w, b):
        return distillation_reference(h @ w.T + b, a.to(h.dtype), ids, kind=kind, tail=True), None

    def fast(h, w, b):
        return linear_distillation_loss(h, w, a.to(h.dtype), ids, bias=b, kind=kind, tail=True)

    exact = _grads(ref, [hidden, weight, bias], w_out)[0]
    ref32 = _grads(ref, [x.float() for x in (hidden, weight, bias)], w_out)[0]
    fast32 = _grads(fast, [x.float() for x in (hidden, weight, bias)], w_out)[0]
    for name, f, r, e in zip(
        ("loss", "hidden", "weight", "bias"), fast32, ref32, exact, strict=True
    ):
        assert f.dtype == torch.float32
        mag = max(float(e.abs().max()), 1.0 if name == "loss" else 0.0)
        assert_error_within(
            f"{kind} {name}", max_abs_err(f, e), max_abs_err(r, e), torch.float32, mag, 3.0
        )


def test_bfloat16_head_runs_in_float32():
    hidden, weight, bias = _head((20,), 30, 8, dtype=torch.bfloat16)
    a, ids = teacher((20, 30), 4)
    h = hidden.requires_grad_()
    loss, _ = linear_distillation_loss(h, weight.requires_grad_(), a, ids, bias=bias, tail=True)
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert h.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    want, _ = distillation_loss(
        (hidden.detach() @ weight.detach().T).float() + bias.float(), a, ids, tail=True
    )
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-5)


def test_no_bias_and_frozen_weight():
    hidden, weight, _ = _head((10,), 12, 4)
    a, ids = teacher((10, 12), 3)
    h = hidden.clone().requires_grad_()
    loss, _ = linear_distillation_loss(h, weight, a, ids)
    loss.sum().backward()
    z = (hidden @ weight.T).requires_grad_()
    distillation_loss(z, a, ids)[0].sum().backward()
    torch.testing.assert_close(h.grad, z.grad @ weight)


def test_gradcheck():
    hidden, weight, bias = _head((3,), 7, 3)
    a, ids = teacher((3, 7), 2)
    fn = lambda h, w, b: linear_distillation_loss(h, w, a, ids, bias=b, kind="jsd", tail=True)[0]  # noqa: E731
    assert torch.autograd.gradcheck(
        fn, (hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_())
    )
