"""Property tests (hypothesis) for ``discounted_cumsum`` and ``gae``.

Inputs are arbitrary: sizes from 0, discounts drawn with extra weight on exactly 0, exactly 1
and values next to them, values spanning many magnitudes (so outputs may cancel), any method
and chunk size. Float64 throughout unless a test says otherwise; tolerances come from the
serial reference's measured error or from the serial loop's a priori bound, never a fixed atol.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from tests.oracles import (
    EXTENDED,
    compact_sequences,
    discounted_cumsum_oracle,
    discounted_returns_oracle,
    gae_oracle,
)
from tests.tolerances import assert_within_bound, assert_within_reference, serial_bound

from rlops import discounted_cumsum, gae

METHODS = ["reference", "chunked", "auto"]
if importlib.util.find_spec("numba") is not None:
    METHODS.append("compiled")

PROPERTY = settings(max_examples=50, deadline=None)

unit = st.one_of(
    st.sampled_from([0.0, 1.0, 0.5, 0.9405, 0.99, 1 - 2**-24, 2**-30]),
    st.floats(0.0, 1.0),
)
finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


@st.composite
def scan_inputs(draw, max_t=70, n_x=1):
    """``n_x`` tensors x ``[B, T]`` (float64) sharing one discount: a float, ``[B, 1]`` or
    ``[B, T]``. Returns ``(x, discount)``, or ``(x1, x2, ..., discount)`` when ``n_x > 1``."""
    b = draw(st.integers(1, 3))
    t = draw(st.integers(0, max_t))
    xs = [torch.from_numpy(draw(arrays(np.float64, (b, t), elements=finite))) for _ in range(n_x)]
    kind = draw(st.sampled_from(["scalar", "row", "token"]))
    if kind == "scalar":
        a = draw(unit)
    else:
        a = torch.from_numpy(
            draw(arrays(np.float64, (b, 1 if kind == "row" else t), elements=unit))
        )
    return (*xs, a)


methods = st.sampled_from(METHODS)
chunk_sizes = st.one_of(st.none(), st.integers(1, 20))


def _abs_oracle(x, a):
    return discounted_cumsum_oracle(x.abs(), a, extended=EXTENDED)


@PROPERTY
@given(scan_inputs(), methods, chunk_sizes, st.sampled_from([torch.float64, torch.float32]))
def test_cumsum_equals_oracle(inputs, method, chunk_size, dtype):
    x, a = inputs
    x = x.to(dtype)
    a = a.to(dtype) if isinstance(a, torch.Tensor) else a
    y = discounted_cumsum(x, a, method=method, chunk_size=chunk_size)
    ref = discounted_cumsum(x, a, method="reference")
    oracle = discounted_cumsum_oracle(x, a, extended=EXTENDED)
    assert y.dtype == dtype and y.shape == x.shape
    if method == "reference" or (dtype == torch.float64 and not EXTENDED):
        bound = serial_bound(x.shape[-1], dtype, _abs_oracle(x, a))
        assert_within_bound(method, y, oracle, bound)
    else:
        assert_within_reference(method, y, oracle, ref, magnitude=_abs_oracle(x, a))


@PROPERTY
@given(scan_inputs(n_x=2), finite, finite, methods, chunk_sizes)
def test_cumsum_is_linear_in_x(inputs, alpha, beta, method, chunk_size):
    x1, x2, a = inputs
    t = x1.shape[-1]

    def f(x):
        return discounted_cumsum(x, a, method=method, chunk_size=chunk_size)

    combined = alpha * x1 + beta * x2
    lhs = f(combined)
    rhs = alpha * f(x1) + beta * f(x2)
    # each of the three scans is within the serial bound of its exact value; the combination
    # of x and of the outputs adds one rounding each (covered by the factor 2)
    scale = (
        _abs_oracle(combined, a) + abs(alpha) * _abs_oracle(x1, a) + abs(beta) * _abs_oracle(x2, a)
    )
    # each scan's subnormal rounding (an absolute term) is scaled by its coefficient too
    underflow = serial_bound(t + 2, torch.float64, np.zeros(1))
    bound = 2 * serial_bound(t + 2, torch.float64, scale) + (abs(alpha) + abs(beta)) * underflow
    assert_within_bound("linearity", lhs, rhs, bound)


@PROPERTY
@given(scan_inputs(), methods, chunk_sizes)
def test_cumsum_satisfies_the_recurrence(inputs, method, chunk_size):
    """y[t] - a[t] * y[t+1] == x[t] (y[T] = 0), the residual formed in extended precision."""
    x, a = inputs
    y = discounted_cumsum(x, a, method=method, chunk_size=chunk_size)
    dt = np.longdouble
    yy = y.numpy().astype(dt)
    aa = np.broadcast_to(a.numpy().astype(dt) if isinstance(a, torch.Tensor) else dt(a), x.shape)
    y_next = np.concatenate([yy[:, 1:], np.zeros((x.shape[0], 1), dtype=dt)], axis=1)
    residual = torch.from_numpy((yy - aa * y_next).astype(np.float64))
    # |residual - x| <= err(y[t]) + a[t] * err(y[t+1]), each err within twice the serial bound
    err = 2 * serial_bound(x.shape[-1], torch.float64, _abs_oracle(x, a))
    err_next = np.concatenate([err[:, 1:], np.zeros((x.shape[0], 1))], axis=1)
    bound = err + aa * err_next + np.abs(x.numpy()) * torch.finfo(torch.float64).eps
    assert_within_bound("recurrence", residual, x, bound)


# ------------------------------------------------------------------------------------- gae


@st.composite
def gae_inputs(draw, max_t=60):
    b = draw(st.integers(1, 3))
    t = draw(st.integers(0, max_t))
    vals = st.floats(-100, 100, allow_nan=False, allow_infinity=False)
    rewards = torch.from_numpy(draw(arrays(np.float64, (b, t), elements=vals)))
    values = torch.from_numpy(draw(arrays(np.float64, (b, t), elements=vals)))
    mask = draw(st.one_of(st.none(), arrays(np.bool_, (b, t))))
    dones = draw(st.one_of(st.none(), arrays(np.bool_, (b, t), elements=st.booleans())))
    mask = None if mask is None else torch.from_numpy(mask)
    dones = None if dones is None else torch.from_numpy(dones)
    per_row = draw(st.booleans())
    if per_row:
        gamma = torch.tensor(draw(st.lists(unit, min_size=b, max_size=b)), dtype=torch.float64)
        lam = torch.tensor(draw(st.lists(unit, min_size=b, max_size=b)), dtype=torch.float64)
    else:
        gamma, lam = draw(unit), draw(unit)
    return rewards, values, mask, dones, gamma, lam


def _row(value, b):
    return value[b].item() if isinstance(value, torch.Tensor) else value


def _gae_bound(rewards, values, gamma, lam, mask, dones):
    """Twice the serial loop's a priori bound, for advantages and for returns."""
    g = gamma if isinstance(gamma, float) else gamma.double()
    gl = g * (lam if isinstance(lam, float) else lam.double())
    vmax = float(values.abs().max()) if values.numel() else 0.0
    x = rewards.abs() + 2 * vmax
    # the scan of |r| + 2 max|V| over the compacted sequences bounds every term's magnitude
    scale = discounted_returns_oracle(x, gl, mask, dones, extended=EXTENDED)
    t = rewards.shape[1] + 2
    bound_a = 2 * serial_bound(t, torch.float64, scale)
    bound_r = 2 * serial_bound(t, torch.float64, scale + np.abs(values.numpy()))
    return bound_a, bound_r


@PROPERTY
@given(gae_inputs(), methods, chunk_sizes)
def test_gae_equals_gae_on_the_compacted_sequences(inputs, method, chunk_size):
    """The compaction invariant, library against itself: on every action token, the masked
    result equals GAE (no mask, no dones) run on that token's compacted sequence."""
    rewards, values, mask, dones, gamma, lam = inputs
    kw = {"method": method, "chunk_size": chunk_size}
    adv, ret = gae(rewards, values, gamma=gamma, lam=lam, mask=mask, dones=dones, **kw)
    adv_c, ret_c = torch.zeros_like(adv), torch.zeros_like(ret)
    for b, seqs in enumerate(compact_sequences(mask, dones, tuple(rewards.shape))):
        for steps in seqs:
            idx = torch.tensor(steps)
            a, r = gae(
                rewards[b, idx][None], values[b, idx][None], gamma=_row(gamma, b),
                lam=_row(lam, b), **kw,
            )  # fmt: skip
            adv_c[b, idx], ret_c[b, idx] = a[0], r[0]
    if mask is not None:
        assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    bound_a, bound_r = _gae_bound(rewards, values, gamma, lam, mask, dones)
    assert_within_bound("advantages", adv, adv_c, bound_a)
    assert_within_bound("returns", ret, ret_c, bound_r)


@PROPERTY
@given(gae_inputs(), chunk_sizes)
def test_gae_chunked_equals_reference(inputs, chunk_size):
    rewards, values, mask, dones, gamma, lam = inputs
    kw = {"gamma": gamma, "lam": lam, "mask": mask, "dones": dones}
    adv, ret = gae(rewards, values, method="chunked", chunk_size=chunk_size, **kw)
    adv_r, ret_r = gae(rewards, values, method="reference", **kw)
    bound_a, bound_r = _gae_bound(rewards, values, gamma, lam, mask, dones)
    assert_within_bound("advantages", adv, adv_r, bound_a)
    assert_within_bound("returns", ret, ret_r, bound_r)


@PROPERTY
@given(gae_inputs(), methods)
def test_gae_equals_oracle(inputs, method):
    rewards, values, mask, dones, gamma, lam = inputs
    adv, ret = gae(rewards, values, gamma=gamma, lam=lam, mask=mask, dones=dones, method=method)
    adv_o, ret_o = gae_oracle(rewards, values, gamma, lam, mask, dones, extended=EXTENDED)
    bound_a, bound_r = _gae_bound(rewards, values, gamma, lam, mask, dones)
    assert_within_bound("advantages", adv, adv_o, bound_a)
    assert_within_bound("returns", ret, ret_o, bound_r)
