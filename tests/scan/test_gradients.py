"""Gradients of the scan and of every estimator built on it.

* ``torch.autograd.gradcheck`` in float64 on tiny shapes (B = 2, T in 1, 5, 7, 9) for the
  differentiable methods, "reference" and "chunked"; the chunked method with chunk sizes 2 and
  4, so that several chunks and the carry recursion between them are exercised. The scan and
  the longest masked rows of each estimator compare the whole Jacobian with finite
  differences; the rest of the estimator matrix uses gradcheck's ``fast_mode`` (random
  projections of the Jacobian), which keeps the file fast on two cores. Discounts
  tested for their own gradient lie strictly inside (0, 1), so the finite differences never
  cross an exact 0 (a cut) or leave the valid range.
* ``method="auto"`` under autograd picks a differentiable method and its gradient is the one
  written from the definition: for ``y[t] = x[t] + a[t] * y[t+1]`` and an upstream gradient
  ``g``, ``dL/dx`` is the *forward* scan ``G[k] = g[k] + a[k-1] * G[k-1]`` and
  ``dL/da[k] = G[k] * y[k+1]``.
* ``method="compiled"`` has no backward: an input that requires grad is a ``ValueError``;
  under ``torch.no_grad()`` the inputs' ``requires_grad`` does not matter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.oracles import EXTENDED
from tests.tolerances import assert_within_bound, needs_numba, serial_bound
from torch.autograd import gradcheck as _gradcheck

import rlops

B = 2
LENGTHS = [1, 5, 7, 9]
# (method, chunk_size): chunk sizes only matter to "chunked"
DIFFERENTIABLE = [("reference", None), ("chunked", 2), ("chunked", 4)]
F64 = torch.float64


def gradcheck(fn, inputs, *, full: bool = True) -> bool:
    """``torch.autograd.gradcheck``: with ``full`` every entry of the Jacobian is compared with
    central differences; otherwise (``fast_mode``) random projections ``u^T J v`` are, one
    backward and two forwards per input instead of one backward per output element."""
    return _gradcheck(fn, inputs, fast_mode=not full)


def _full(T: int, scenario: str = "mask+dones") -> bool:
    """The exact Jacobian on the longest rows with masks and dones; projections elsewhere."""
    return T == max(LENGTHS) and scenario == "mask+dones"


def _ids(case) -> str:
    method, chunk = case
    return method if chunk is None else f"{method}-C{chunk}"


def _randn(*shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64)


def _unit(*shape, seed: int) -> torch.Tensor:
    """Discounts strictly inside (0, 1): in [0.2, 0.95]."""
    g = torch.Generator().manual_seed(seed)
    return 0.2 + 0.75 * torch.rand(*shape, generator=g, dtype=F64)


# A mask with interior mask-0 spans (tool output) and a mask-0 tail, and dones in both rows.
_MASK = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0, 1], [1, 0, 1, 1, 1, 0, 0, 1, 0]], dtype=torch.bool)
_DONES = torch.zeros(2, 9, dtype=torch.bool)
_DONES[0, 4] = True
_DONES[1, 2] = True
SCENARIOS = ["plain", "mask", "dones", "mask+dones"]


def _indicators(scenario: str, t_len: int):
    mask = _MASK[:, :t_len] if "mask" in scenario else None
    dones = _DONES[:, :t_len] if "dones" in scenario else None
    return mask, dones


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


# --------------------------------------------------------------------------- the scan
@pytest.mark.parametrize("case", DIFFERENTIABLE, ids=_ids)
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("kind", ["scalar", "row", "token"])
def test_cumsum_gradcheck(case, T, kind):
    method, chunk = case
    x = _leaf(_randn(B, T, seed=T))
    inputs = [x]
    if kind == "scalar":
        discount = 0.9
    else:
        discount = _leaf(_unit(B, 1 if kind == "row" else T, seed=T + 1))
        inputs.append(discount)

    def fn(x, *a):
        return rlops.discounted_cumsum(x, a[0] if a else discount, method=method, chunk_size=chunk)

    assert gradcheck(fn, tuple(inputs))


@pytest.mark.parametrize("case", DIFFERENTIABLE, ids=_ids)
def test_cumsum_gradcheck_along_another_dim(case):
    """Time along dim 1 of a 3-d tensor, with a per-token discount broadcast over the last dim."""
    method, chunk = case
    x = _leaf(_randn(2, 7, 3, seed=10))
    a = _leaf(_unit(2, 7, 1, seed=11))
    assert gradcheck(
        lambda x, a: rlops.discounted_cumsum(x, a, dim=1, method=method, chunk_size=chunk),
        (x, a),
    )


@pytest.mark.parametrize("case", DIFFERENTIABLE, ids=_ids)
def test_cumsum_gradcheck_with_exact_cuts(case):
    """Per-token discounts with exact zeros (episode ends) and ones: gradient w.r.t. x (the
    zeros are constants here; finite differences in the discount would cross them)."""
    method, chunk = case
    a = _unit(B, 9, seed=12)
    a[0, 3] = 0.0
    a[1, 6] = 0.0
    a[:, 1] = 1.0
    x = _leaf(_randn(B, 9, seed=13))
    assert gradcheck(lambda x: rlops.discounted_cumsum(x, a, method=method, chunk_size=chunk), (x,))


# --------------------------------------------------------------------------- estimators
@pytest.mark.parametrize("case", DIFFERENTIABLE, ids=_ids)
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_gae_gradcheck(case, T, scenario):
    method, chunk = case
    mask, dones = _indicators(scenario, T)
    r, v = _leaf(_randn(B, T, seed=20 + T)), _leaf(_randn(B, T, seed=30 + T))

    def fn(r, v):
        return rlops.gae(
            r, v, gamma=0.95, lam=0.9, mask=mask, dones=dones, method=method, chunk_size=chunk
        )

    assert gradcheck(fn, (r, v), full=_full(T, scenario))


@pytest.mark.parametrize("case", DIFFERENTIABLE, ids=_ids)
def test_gae_gradcheck_per_row_discounts(case):
    """Per-row ``gamma`` and ``lam`` ``[B]`` are differentiable too (e.g. a learned lambda)."""
    method, chunk = case
    mask, dones = _indicators("mask+dones", 9)
    r, v = _leaf(_randn(B, 9, seed=40)), _leaf(_randn(B, 9, seed=41))
    gamma, lam = _leaf(_unit(B, seed=42)), _leaf(_unit(B, seed=43))

    def fn(r, v, gamma, lam):
        return rlops.gae(
            r, v, gamma=gamma, lam=lam, mask=mask, dones=dones, method=method, chunk_size=chunk
        )

    assert gradcheck(fn, (r, v, gamma, lam))


@pytest.mark.parametrize("case", DIFFERENTIABLE, ids=_ids)
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_discounted_returns_gradcheck(case, T, scenario):
    method, chunk = case
    mask, dones = _indicators(scenario, T)
    r = _leaf(_randn(B, T, seed=50 + T))
    gamma = _leaf(_unit(B, seed=51))

    def fn(r, gamma):
        return rlops.discounted_returns(
            r, gamma=gamma, mask=mask, dones=dones, method=method, chunk_size=chunk
        )

    assert gradcheck(fn, (r, gamma), full=_full(T, scenario))
    assert gradcheck(lambda r: fn(r, 0.9), (r,), full=_full(T, scenario))


@pytest.mark.parametrize("method", ["reference", "chunked"])
@pytest.mark.parametrize("T", LENGTHS)
def test_reinforce_plus_plus_returns_gradcheck(method, T):
    """W.r.t. the outcome scores and the KL, with interior mask-0 spans and a row whose last
    token is mask 0 (the outcome lands on the last *action* token)."""
    mask = _MASK[:, :T]
    outcome, kl = _leaf(_randn(B, seed=60 + T)), _leaf(_randn(B, T, seed=70 + T))

    def fn(outcome, kl):
        return rlops.reinforce_plus_plus_returns(
            outcome, kl, mask, kl_coef=0.1, gamma=0.95, method=method
        )

    assert gradcheck(fn, (outcome, kl), full=_full(T))


# --------------------------------------------------------------------------- method="auto"
def _reverse_scan(xs: np.ndarray, a_s: np.ndarray) -> np.ndarray:
    """``y[t] = x[t] + a[t] * y[t+1]`` by the loop, with the ``y[T] = 0`` column kept."""
    y = np.zeros((xs.shape[0], xs.shape[1] + 1), dtype=xs.dtype)
    for t in reversed(range(xs.shape[1])):
        y[:, t] = xs[:, t] + a_s[:, t] * y[:, t + 1]
    return y


def _forward_scan(gs: np.ndarray, a_s: np.ndarray) -> np.ndarray:
    """``G[k] = g[k] + a[k-1] * G[k-1]`` by the loop."""
    out = np.zeros_like(gs)
    carry = np.zeros(gs.shape[0], dtype=gs.dtype)
    for k in range(gs.shape[1]):
        carry = gs[:, k] + (a_s[:, k - 1] * carry if k > 0 else 0)
        out[:, k] = carry
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy().astype(np.longdouble if EXTENDED else np.float64)


def _defined_grads(x: torch.Tensor, a: torch.Tensor, g: torch.Tensor):
    """``(dL/dx, dL/da)`` for ``L = sum(g * y)``, ``y[t] = x[t] + a[t] * y[t+1]``, from the
    definition in extended precision: ``dL/dx = G`` (the forward scan of ``g``) and
    ``dL/da[k] = G[k] * y[k+1]``; and the magnitudes that bound their rounding (the same
    loops on absolute values)."""
    xs, a_s, gs = _np(x), _np(a), _np(g)
    big_g, y = _forward_scan(gs, a_s), _reverse_scan(xs, a_s)
    abs_g = _forward_scan(np.abs(gs), np.abs(a_s))
    abs_y = _reverse_scan(np.abs(xs), np.abs(a_s))
    return (big_g, big_g * y[:, 1:]), (abs_g, abs_g * abs_y[:, 1:])


@pytest.mark.parametrize("T", [1, 9, 200])
def test_auto_under_autograd_gives_the_defined_gradient(T):
    x = _leaf(_randn(B, T, seed=80))
    a = _leaf(_unit(B, T, seed=81))
    g = _randn(B, T, seed=82)
    y = rlops.discounted_cumsum(x, a)  # method="auto"
    assert y.grad_fn is not None
    y.backward(g)
    (want_x, want_a), (mag_x, mag_a) = _defined_grads(x, a, g)
    # a priori bounds of the serial loops: the forward scan for dL/dx; for dL/da = G * y,
    # the roundings of both scans and of the product
    assert_within_bound("dL/dx", x.grad, want_x, serial_bound(T, F64, mag_x))
    assert_within_bound("dL/da", a.grad, want_a, serial_bound(2 * T + 1, F64, mag_a))


def _estimator_calls(r, v, outcome, kl, mask, dones, method):
    return {
        "gae": lambda: rlops.gae(r, v, gamma=0.95, lam=0.9, mask=mask, dones=dones, method=method),
        "discounted_returns": lambda: rlops.discounted_returns(
            r, gamma=0.95, mask=mask, dones=dones, method=method
        ),
        "reinforce_plus_plus_returns": lambda: rlops.reinforce_plus_plus_returns(
            outcome, kl, mask, kl_coef=0.1, gamma=0.95, method=method
        ),
        "discounted_cumsum": lambda: rlops.discounted_cumsum(r, 0.95, method=method),
    }


def _sum_outputs(out) -> torch.Tensor:
    outs = out if isinstance(out, tuple) else (out,)
    weights = (1.0, 0.5)
    return sum(
        w * (o * torch.arange(o.numel(), dtype=o.dtype).view_as(o).cos()).sum()
        for w, o in zip(weights, outs)
    )


@pytest.mark.parametrize(
    "name", ["gae", "discounted_returns", "reinforce_plus_plus_returns", "discounted_cumsum"]
)
def test_auto_under_autograd_is_the_chunked_gradient(name):
    """``auto`` with inputs that require grad returns a result with a ``grad_fn`` whose
    gradients pass gradcheck and equal those of ``chunked`` (the method it must pick)."""
    mask, dones = _indicators("mask+dones", 9)
    base = [_randn(B, 9, seed=90), _randn(B, 9, seed=91), _randn(B, seed=92), _randn(B, 9, seed=93)]
    grads = {}
    for method in ("auto", "chunked"):
        r, v, outcome, kl = (_leaf(t) for t in base)
        out = _estimator_calls(r, v, outcome, kl, mask, dones, method)[name]()
        first = out[0] if isinstance(out, tuple) else out
        assert first.grad_fn is not None, method
        _sum_outputs(out).backward()
        grads[method] = [t.grad for t in (r, v, outcome, kl)]
    for got, want in zip(grads["auto"], grads["chunked"], strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want)

    def fn(r, v, outcome, kl):
        return _estimator_calls(r, v, outcome, kl, mask, dones, "auto")[name]()

    assert gradcheck(fn, tuple(_leaf(t) for t in base))


@needs_numba
@pytest.mark.parametrize(
    "name",
    [
        "gae gamma",
        "gae lam",
        "discounted_returns gamma",
        "reinforce_plus_plus_returns gamma",
        "discounted_cumsum per-row discount",
    ],
)
def test_auto_when_only_a_discount_requires_grad(name):
    r = _randn(B, 9, seed=100)
    mask = _MASK
    d = _leaf(_unit(B, seed=101))
    calls = {
        "gae gamma": lambda: rlops.gae(r, r, gamma=d, lam=0.9)[0],
        "gae lam": lambda: rlops.gae(r, r, gamma=0.9, lam=d)[0],
        "discounted_returns gamma": lambda: rlops.discounted_returns(r, gamma=d),
        "reinforce_plus_plus_returns gamma": lambda: rlops.reinforce_plus_plus_returns(
            r[:, 0], r, mask, kl_coef=0.1, gamma=d
        ),
        "discounted_cumsum per-row discount": lambda: rlops.discounted_cumsum(r, d[:, None]),
    }
    out = calls[name]()
    assert out.grad_fn is not None
    out.sum().backward()
    assert d.grad is not None and torch.isfinite(d.grad).all()


# --------------------------------------------------------------------------- method="compiled"
@needs_numba
@pytest.mark.parametrize(
    "name",
    [
        "cumsum x",
        "cumsum discount",
        "gae rewards",
        "gae values",
        "returns rewards",
        "reinforce++ kl",
        "reinforce++ outcome",
    ],
)
def test_compiled_with_an_input_that_requires_grad_raises(name):
    x = _randn(B, 9, seed=110)
    mask = _MASK
    leaf = _leaf(x)
    calls = {
        "cumsum x": lambda: rlops.discounted_cumsum(leaf, 0.9, method="compiled"),
        "cumsum discount": lambda: rlops.discounted_cumsum(
            x, _leaf(_unit(B, 9, seed=1)), method="compiled"
        ),
        "gae rewards": lambda: rlops.gae(leaf, x, gamma=0.9, lam=0.9, method="compiled"),
        "gae values": lambda: rlops.gae(x, leaf, gamma=0.9, lam=0.9, method="compiled"),
        "returns rewards": lambda: rlops.discounted_returns(leaf, gamma=0.9, method="compiled"),
        "reinforce++ kl": lambda: rlops.reinforce_plus_plus_returns(
            x[:, 0], leaf, mask, kl_coef=0.1, gamma=0.9, method="compiled"
        ),
        "reinforce++ outcome": lambda: rlops.reinforce_plus_plus_returns(
            _leaf(x[:, 0]), x, mask, kl_coef=0.1, gamma=0.9, method="compiled"
        ),
    }
    with pytest.raises(ValueError, match="grad"):
        calls[name]()


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("method", ["auto", pytest.param("compiled", marks=needs_numba)])
def test_requires_grad_does_not_matter_without_autograd(grad_mode, method):
    """Under ``torch.no_grad()`` (or inference mode) inputs that require grad run through
    ``auto`` and ``compiled``, return no ``grad_fn``, and give exactly the result of the same
    call on detached inputs."""
    mask, dones = _indicators("mask+dones", 9)
    base = [
        _randn(B, 9, seed=120),
        _randn(B, 9, seed=121),
        _randn(B, seed=122),
        _randn(B, 9, seed=123),
    ]
    want = {k: f() for k, f in _estimator_calls(*base, mask, dones, method).items()}
    leaves = [_leaf(t) for t in base]
    context = torch.no_grad if grad_mode == "no_grad" else torch.inference_mode
    with context():
        got = {k: f() for k, f in _estimator_calls(*leaves, mask, dones, method).items()}
    for name in want:
        outs_got = got[name] if isinstance(got[name], tuple) else (got[name],)
        outs_want = want[name] if isinstance(want[name], tuple) else (want[name],)
        for g, w in zip(outs_got, outs_want, strict=True):
            assert g.grad_fn is None and not g.requires_grad, name
            assert torch.equal(g, w), name
