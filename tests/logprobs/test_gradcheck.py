"""First and second derivatives of every autograd path of the log-prob ops, in float64.

``torch.autograd.gradcheck`` compares the backward with finite differences of the forward, and
``gradgradcheck`` the double backward (``create_graph=True``) with finite differences of the
backward, on tiny shapes: logits and linear paths, temperature, keep mask, chunking,
``entropy_grad`` on and off, ``with_entropy=False`` and a ``-inf`` logit.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from rlops.logprobs import linear_logprobs_and_entropy, logprobs_and_entropy

N, V, H = 5, 6, 3

LOGITS_PATHS = {
    "plain": {},
    "temperature, chunked": {"temperature": 0.7, "chunk_size": 2},
    "keep mask": {"mask": True, "chunk_size": 4},
    "keep mask, temperature": {"mask": True, "temperature": 1.7, "chunk_size": 3},
    "entropy detached": {"entropy_grad": False},
    "entropy detached, keep mask": {"entropy_grad": False, "mask": True, "temperature": 0.5},
    "no entropy": {"with_entropy": False, "chunk_size": 2},
    "no entropy, keep mask": {"with_entropy": False, "mask": True, "temperature": 1.3},
    "-inf logit": {"minus_inf": True, "chunk_size": 3},
    "-inf logit, keep mask": {"minus_inf": True, "mask": True},
}
LINEAR_PATHS = {
    "plain": {},
    "temperature, chunked": {"temperature": 1.7, "chunk_size": 2},
    "no entropy": {"with_entropy": False, "temperature": 0.6},
}


def _logits_case(name: str):
    kw = dict(LOGITS_PATHS[name])
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    logits = torch.randn(N, V, dtype=torch.float64, generator=gen)
    target = torch.randint(1, V, (N,), generator=gen)  # never id 0 (the -inf one below)
    if kw.pop("minus_inf", False):
        logits[:, 0] = float("-inf")
    if kw.pop("mask", False):
        kw["keep_mask"] = torch.rand(N, V, generator=gen) < 0.5  # targets kept or not
    return logits.requires_grad_(), target, kw


def _differentiable(outs):
    """The outputs gradcheck can differentiate (the entropy may be None or detached)."""
    return tuple(o for o in outs if o is not None and o.requires_grad)


def _logits_fn(target, kw):
    return lambda x: _differentiable(logprobs_and_entropy(x, target, **kw))


def _linear_case(name: str):
    gen = torch.Generator().manual_seed(sum(map(ord, name)) + 1)
    hidden = torch.randn(N, H, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, generator=gen, requires_grad=True)
    target = torch.randint(0, V, (N,), generator=gen)
    return hidden, weight, target, dict(LINEAR_PATHS[name])


def _linear_fn(target, kw):
    return lambda h, w: _differentiable(linear_logprobs_and_entropy(h, w, target, **kw))


@pytest.mark.parametrize("name", LOGITS_PATHS)
def test_logits_gradcheck_and_gradgradcheck(name):
    logits, target, kw = _logits_case(name)
    fn = _logits_fn(target, kw)
    assert gradcheck(fn, (logits,))
    assert gradgradcheck(fn, (logits,))


@pytest.mark.parametrize("name", LINEAR_PATHS)
def test_linear_gradcheck_and_gradgradcheck(name):
    hidden, weight, target, kw = _linear_case(name)
    fn = _linear_fn(target, kw)
    assert gradcheck(fn, (hidden, weight))
    assert gradgradcheck(fn, (hidden, weight))


@pytest.mark.parametrize("wrt", ["hidden", "weight"])
def test_linear_one_input_needs_grad(wrt):
    hidden, weight, target, kw = _linear_case("temperature, chunked")
    fn = _linear_fn(target, kw)
    if wrt == "hidden":
        only, x = (lambda h: fn(h, weight.detach())), hidden
    else:
        only, x = (lambda w: fn(hidden.detach(), w)), weight
    assert gradcheck(only, (x,))
    assert gradgradcheck(only, (x,))


def test_second_derivative_by_hand():
    """Two classes, z = (0, log 3): p = (1/4, 3/4). For logp_0 = z_0 − lse(z),
    ∂²logp_0/∂z_0² = −p_0·p_1 = −3/16 and ∂²logp_0/∂z_0∂z_1 = +p_0·p_1. The entropy
    H = −Σ p log p has ∂H/∂z_0 = −p_0 (log p_0 + H) and, differentiating that again,
    ∂²H/∂z_0² = −p_0 p_1 (log p_0 + H) − p_0 (p_1 − p_0 p_1 (log p_0 − log p_1))."""
    z = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64, requires_grad=True)
    logp, ent = logprobs_and_entropy(z, torch.tensor([0]))
    (g,) = torch.autograd.grad(logp.sum(), z, create_graph=True)
    (gg,) = torch.autograd.grad(g[0, 0], z)
    p0, p1 = 0.25, 0.75
    torch.testing.assert_close(gg, torch.tensor([[-p0 * p1, p0 * p1]], dtype=torch.float64))
    (g,) = torch.autograd.grad(ent.sum(), z, create_graph=True)
    h = -(p0 * math.log(p0) + p1 * math.log(p1))
    torch.testing.assert_close(g[0, 0].item(), -p0 * (math.log(p0) + h))
    (gg,) = torch.autograd.grad(g[0, 0], z)
    d_h = -p0 * (math.log(p0) + h)  # ∂H/∂z_0
    # ∂/∂z_0 of −p_0 (log p_0 + H): ∂p_0/∂z_0 = p_0 p_1, ∂log p_0/∂z_0 = p_1.
    want = -(p0 * p1) * (math.log(p0) + h) - p0 * (p1 + d_h)
    torch.testing.assert_close(gg[0, 0].item(), want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_backward_with_graph_equals_the_fused_backward(dtype):
    """create_graph=True takes the differentiable path: same first derivatives."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(9, 33, generator=gen) * 4).to(dtype)
    logits[:, 5] = float("-inf")
    target = torch.randint(6, 33, (9,), generator=gen)
    keep = torch.rand(9, 33, generator=gen) < 0.4
    grads = (torch.randn(9, generator=gen), torch.randn(9, generator=gen))
    for kw in ({}, {"keep_mask": keep, "temperature": 0.7, "chunk_size": 4}):
        got = []
        for create_graph in (False, True):
            x = logits.clone().requires_grad_()
            logp, ent = logprobs_and_entropy(x, target, **kw)
            (g,) = torch.autograd.grad(
                (logp, ent), x, [t.to(logp.dtype) for t in grads], create_graph=create_graph
            )
            assert g.dtype == dtype and g.requires_grad == create_graph
            got.append(g.detach())
        tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
        torch.testing.assert_close(got[1], got[0], rtol=tol, atol=tol)
