"""Truncated rows bootstrap: ``bootstrap=`` and ``truncated=`` of ``rlops.gae`` and
``rlops.discounted_returns`` against the compacted-sequence oracle with the bootstrap written
plainly (``tests/oracles.py``), on every method, odd sizes, edge discounts and three dtypes;
hand-computed values; torchrl's done/terminated recurrence; gradients; bad input to
``bootstrap=``, ``truncated=`` and ``cp_layout=`` (errors name the argument and what it
accepts); a property test. Tolerances as in ``tests/tolerances.py``.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests._bad_input import names
from tests.advantages.test_gae_and_returns import (
    DTYPES,
    HALF,
    _seed,
    check_estimate,
    make_batch,
)
from tests.advantages.test_gae_and_returns import (
    make_discounts as per_row_discounts,
)
from tests.oracles import (
    EXTENDED,
    discounted_returns_bootstrap_oracle,
    discounted_returns_oracle,
    gae_bootstrap_oracle,
)
from tests.tolerances import ALL_METHODS, for_each_method

from rlops import discounted_returns, gae

SIZES = [(1, 1), (3, 1), (1, 127), (4, 129)]  # (B, T); with (4, 128), (4, 1000) below
LONGER = [(4, 128), (4, 1000)]
SCENARIOS = ["plain", "mask", "mask+dones"]
FORMS = ["row", "token"]
# (gamma, lam): the edges 0 and 1, a usual pair, and one discount per row
DISCOUNTS = {"0-0": (0.0, 0.0), "1-1": (1.0, 1.0), "0.99-0.95": (0.99, 0.95)}
PER_ROW = "per-row"


def make_discounts(name, B):
    return per_row_discounts(name, B) if name == PER_ROW else DISCOUNTS[name]


def make_bootstrap(B, T, form, dtype, mask, dones, seed):
    """``(bootstrap, truncated)``: ``[B]`` values; or ``[B, T]`` values with NaN wherever they
    must not be read and ~3% truncations, one of them on a mask-0 token where a row has one,
    one on some row's last token."""
    rng = np.random.default_rng(seed)
    if form == "row":
        return torch.from_numpy(rng.standard_normal(B) * 3).to(dtype), None
    trunc = rng.random((B, T)) < 0.03
    if mask is not None:
        for b in range(B):
            off = np.flatnonzero(~mask[b].numpy())
            if off.size:
                trunc[b, rng.choice(off)] = True
    trunc[0, T - 1] = True
    if dones is not None:  # a token in both: the truncation wins
        trunc[1 % B] |= dones[1 % B].numpy() & (rng.random(T) < 0.5)
    boot = rng.standard_normal((B, T)) * 3
    boot[~trunc] = np.nan  # never read
    return torch.from_numpy(boot).to(dtype), torch.from_numpy(trunc)


def _full(dtype):
    return torch.float32 if dtype in HALF else dtype


@functools.lru_cache(maxsize=8)
def case_inputs(B, T, scenario, dtype_name, discounts, form):
    dtype = DTYPES[dtype_name]
    seed = _seed(B, T, scenario, form)
    rewards, values, mask, dones = make_batch(B, T, scenario, dtype, seed)
    boot, trunc = make_bootstrap(B, T, form, dtype, mask, dones, seed + 1)
    gamma, lam = make_discounts(discounts, B)
    return rewards, values, mask, dones, boot, trunc, gamma, lam


def _scale(rewards, values, boot, gamma, lam, mask, dones, trunc, with_values):
    """An upper bound on the sum of |terms| behind every output (for the a priori bound)."""
    g = gamma if isinstance(gamma, float) else gamma.double()
    gl = g if not with_values else g * (lam if isinstance(lam, float) else lam.double())
    vmax = float(values.double().abs().max()) if with_values and values.numel() else 0.0
    bmax = float(torch.nan_to_num(boot.double(), nan=0.0).abs().max()) if boot.numel() else 0.0
    x = rewards.double().abs() + 2 * vmax + bmax
    ends = dones if trunc is None else (trunc if dones is None else dones | trunc)
    scale = discounted_returns_oracle(x, gl, mask, ends, extended=EXTENDED)
    if not with_values:
        return scale
    return scale, scale + np.abs(values.double().numpy())


# float32 on every size and discount; float64 and bfloat16 on T = 129; T = 128 and 1000 with
# the usual discounts
GRID = [
    pytest.param((B, T, sc, dt, disc, form), id=f"{dt}-{sc}-{disc}-{form}-T{T}-B{B}")
    for dt, sc, disc, form, (B, T) in itertools.product(
        DTYPES, SCENARIOS, [*DISCOUNTS, PER_ROW], FORMS, SIZES + LONGER
    )
    if (dt == "float32" and (B, T) in SIZES)
    or (dt != "float32" and (B, T) == (4, 129))
    or ((B, T) in LONGER and disc == "0.99-0.95" and dt == "float32")
]


@pytest.mark.parametrize("case", GRID)
def test_gae_bootstrap_matches_oracle(case):
    T = case[1]
    rewards, values, mask, dones, boot, trunc, gamma, lam = case_inputs(*case)
    adv_o, ret_o = gae_bootstrap_oracle(
        rewards, values, gamma, lam, mask, dones, boot, trunc, extended=EXTENDED
    )
    full = _full(rewards.dtype)
    adv_r, ret_r = gae(
        rewards.to(full), values.to(full), gamma=gamma, lam=lam, mask=mask, dones=dones,
        bootstrap=boot.to(full), truncated=trunc, method="reference",
    )  # fmt: skip
    scale_a, scale_r = _scale(rewards, values, boot, gamma, lam, mask, dones, trunc, True)

    def check(method):
        adv, ret = gae(
            rewards, values, gamma=gamma, lam=lam, mask=mask, dones=dones, bootstrap=boot,
            truncated=trunc, method=method,
        )  # fmt: skip
        assert adv.dtype == rewards.dtype and adv.shape == rewards.shape
        if mask is not None:
            assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
        check_estimate(f"{case} advantages", adv, adv_o, adv_r, method, T + 1, scale_a)
        check_estimate(f"{case} returns", ret, ret_o, ret_r, method, T + 1, scale_r)

    for_each_method(check)


@pytest.mark.parametrize("case", GRID)
def test_discounted_returns_bootstrap_matches_oracle(case):
    T = case[1]
    rewards, values, mask, dones, boot, trunc, gamma, lam = case_inputs(*case)
    oracle = discounted_returns_bootstrap_oracle(
        rewards, gamma, mask, dones, boot, trunc, extended=EXTENDED
    )
    full = _full(rewards.dtype)
    ref = discounted_returns(
        rewards.to(full), gamma=gamma, mask=mask, dones=dones, bootstrap=boot.to(full),
        truncated=trunc, method="reference",
    )  # fmt: skip
    scale = _scale(rewards, values, boot, gamma, lam, mask, dones, trunc, False)

    def check(method):
        out = discounted_returns(
            rewards, gamma=gamma, mask=mask, dones=dones, bootstrap=boot, truncated=trunc,
            method=method,
        )  # fmt: skip
        assert out.dtype == rewards.dtype and out.shape == rewards.shape
        if mask is not None:
            assert (out[~mask] == 0).all()
        check_estimate(str(case), out, oracle, ref, method, T + 1, scale)

    for_each_method(check)


# --------------------------------------------------------------------------- by hand


def test_hand_computed_values():
    """Small cases worked out on paper."""
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 0.5, 0.5]], dtype=torch.float64)
    # gamma = lam = 1, V(s_T) = 2: delta = [0, 0, 1 + 2 - 0.5], A = cumulative sums
    for method in ALL_METHODS:
        adv, ret = gae(r, v, gamma=1.0, lam=1.0, bootstrap=torch.tensor([2.0]), method=method)
        torch.testing.assert_close(adv, torch.tensor([[2.5, 2.5, 2.5]], dtype=torch.float64))
        torch.testing.assert_close(ret, torch.tensor([[3.0, 3.0, 3.0]], dtype=torch.float64))
    # a tool output (mask 0) at the end passes V(s_T) through: one gamma to the last action
    m = torch.tensor([[1, 1, 0]])
    for method in ALL_METHODS:
        out = discounted_returns(
            torch.tensor([[1.0, 1.0, 9.0]]), gamma=0.5, mask=m, bootstrap=torch.tensor([4.0]),
            method=method,
        )  # fmt: skip
        # G[1] = 1 + 0.5 * 4 = 3, G[0] = 1 + 0.5 * 3 = 2.5
        torch.testing.assert_close(out, torch.tensor([[2.5, 3.0, 0.0]]))
    # packed: a truncation at t=1 (value after it 3), a termination at t=3 (done), the last
    # piece cut by the row's end with no truncation marked: terminated
    r = torch.tensor([[0.0, 1.0, 0.0, 1.0, 2.0]])
    tr = torch.tensor([[0, 1, 0, 0, 0]])
    d = torch.tensor([[0, 0, 0, 1, 0]])
    boot = torch.tensor([[float("nan"), 3.0, float("nan"), 7.0, float("nan")]])
    for method in ALL_METHODS:
        out = discounted_returns(r, gamma=0.5, dones=d, bootstrap=boot, truncated=tr, method=method)
        torch.testing.assert_close(out, torch.tensor([[1.25, 2.5, 0.5, 1.0, 2.0]]))
    # a truncation on a mask-0 token (a cut after a tool output): the value after it reaches
    # the last action token before it, one gamma away; V = 0 here, so A = G
    m = torch.tensor([[1, 0, 1, 1]])
    tr = torch.tensor([[0, 1, 0, 0]])
    boot = torch.tensor([[0.0, 10.0, 0.0, 0.0]])
    for method in ALL_METHODS:
        adv, _ = gae(
            torch.ones(1, 4), torch.zeros(1, 4), gamma=0.5, lam=1.0, mask=m, bootstrap=boot,
            truncated=tr, method=method,
        )  # fmt: skip
        torch.testing.assert_close(adv, torch.tensor([[6.0, 0.0, 1.5, 1.0]]))


def test_zero_discount_cuts_the_bootstrap_exactly():
    """gamma = 0: the bootstrap is selected away, even when it is inf or NaN."""
    r = torch.tensor([[1.0, 2.0]])
    v = torch.tensor([[0.5, 0.25]])
    tr = torch.tensor([[1, 0]])
    for boot, trunc in (
        (torch.tensor([float("inf")]), None),
        (torch.tensor([float("nan")]), None),
        (torch.tensor([[float("inf"), 0.0]]), tr),
    ):
        for method in ALL_METHODS:
            out = discounted_returns(r, gamma=0.0, bootstrap=boot, truncated=trunc, method=method)
            assert torch.equal(out, r), (method, out)
            adv, _ = gae(r, v, gamma=0.0, lam=0.5, bootstrap=boot, truncated=trunc,
                         method=method)  # fmt: skip
            assert torch.equal(adv, r - v), (method, adv)


def test_row_bootstrap_equals_token_bootstrap_marked_at_the_end():
    g = torch.Generator().manual_seed(3)
    r, v = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)
    mask = torch.rand(3, 40, generator=g) > 0.3
    dones = torch.rand(3, 40, generator=g) > 0.95
    boot = torch.randn(3, generator=g)
    per_token = torch.full((3, 40), float("nan"))
    per_token[:, -1] = boot
    trunc = torch.zeros(3, 40, dtype=torch.bool)
    trunc[:, -1] = ~dones[:, -1]  # a done at the last token terminates in both forms
    for method in ALL_METHODS:
        kw = dict(gamma=0.9, lam=0.8, mask=mask, dones=dones, method=method)
        a1, r1 = gae(r, v, bootstrap=boot, **kw)
        a2, r2 = gae(r, v, bootstrap=per_token, truncated=trunc, **kw)
        torch.testing.assert_close(a1, a2, rtol=0, atol=0)
        torch.testing.assert_close(r1, r2, rtol=0, atol=0)


def _torchrl_gae(gamma, lam, state_value, next_state_value, reward, done, terminated):
    """torchrl's ``generalized_advantage_estimate`` (objectives/value/functional.py), its
    documented recurrence over the last dim: ``delta = r + gamma * (1 - terminated) *
    next_state_value - state_value``, ``A[t] = delta[t] + gamma * lam * (1 - done[t]) *
    A[t + 1]``."""
    not_done = (~done).double()
    not_term = (~terminated).double()
    delta = reward + gamma * not_term * next_state_value - state_value
    adv = torch.zeros_like(reward)
    prev = torch.zeros_like(reward[..., 0])
    for t in reversed(range(reward.shape[-1])):
        prev = delta[..., t] + gamma * lam * not_done[..., t] * prev
        adv[..., t] = prev
    return adv, adv + state_value


def test_matches_torchrl_done_and_terminated():
    """rlops(dones=done, truncated=done & ~terminated (+ the last step where not done),
    bootstrap=next_state_value) == torchrl when next_state_value[t] = V[t+1] inside episodes."""
    g = torch.Generator().manual_seed(7)
    B, T = 4, 50
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    done = torch.rand(B, T, generator=g) > 0.85
    terminated = done & (torch.rand(B, T, generator=g) > 0.5)
    nxt = torch.cat([v[:, 1:], torch.zeros(B, 1, dtype=torch.float64)], -1)
    fresh = torch.randn(B, T, generator=g, dtype=torch.float64)  # V(s') after a cut
    nsv = torch.where(done, fresh, nxt)
    nsv[:, -1] = fresh[:, -1]
    want = _torchrl_gae(0.97, 0.9, v, nsv, r, done, terminated)
    trunc = done & ~terminated
    trunc[:, -1] |= ~done[:, -1]
    for method in ALL_METHODS:
        got = gae(r, v, gamma=0.97, lam=0.9, dones=done, bootstrap=nsv, truncated=trunc,
                  method=method)  # fmt: skip
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- gradients


def test_gradients_match_reference_and_gradcheck():
    g = torch.Generator().manual_seed(11)
    B, T = 3, 37
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    dones = torch.rand(B, T, generator=g) > 0.9
    trunc = torch.rand(B, T, generator=g) > 0.9
    boot_t = torch.randn(B, T, generator=g, dtype=torch.float64)
    boot_r = torch.randn(B, generator=g, dtype=torch.float64)
    up = torch.randn(2, B, T, generator=g, dtype=torch.float64)
    for boot, tr in ((boot_r, None), (boot_t, trunc)):
        grads = {}
        for method in ("reference", "chunked", "auto"):
            leaves = [x.clone().requires_grad_() for x in (r, v, boot)]
            adv, ret = gae(
                leaves[0], leaves[1], gamma=0.9, lam=0.95, mask=mask, dones=dones,
                bootstrap=leaves[2], truncated=tr, method=method,
            )  # fmt: skip
            ((adv * up[0]).sum() + (ret * up[1]).sum()).backward()
            grads[method] = [x.grad for x in leaves]
            leaves = [x.clone().requires_grad_() for x in (r, boot)]
            out = discounted_returns(
                leaves[0],
                gamma=0.9,
                mask=mask,
                dones=dones,
                bootstrap=leaves[1],
                truncated=tr,
                method=method,
            )
            (out * up[0]).sum().backward()
            grads[method] += [x.grad for x in leaves]
        for method in ("chunked", "auto"):
            for a, b in zip(grads[method], grads["reference"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        # gradient with respect to the bootstrap: gamma at the last action token of each cut
        # sequence, propagated back by gamma * lam (checked numerically)
        small = [x[:2, :9].clone().requires_grad_() for x in (r, v)]
        bs = (boot[:2, :9] if boot.dim() == 2 else boot[:2]).clone().requires_grad_()
        tr_s = None if tr is None else tr[:2, :9]

        def f(rr, vv, bb, tr_s=tr_s):
            return gae(rr, vv, gamma=0.9, lam=0.95, mask=mask[:2, :9], dones=dones[:2, :9],
                       bootstrap=bb, truncated=tr_s, method="chunked")  # fmt: skip

        assert torch.autograd.gradcheck(f, (*small, bs))


# --------------------------------------------------------------------------- errors


def test_bad_arguments_name_themselves():
    r = torch.zeros(2, 5)
    v = torch.zeros(2, 5)
    with pytest.raises(TypeError, match=r"bootstrap must be a torch\.Tensor"):
        gae(r, v, gamma=1.0, lam=1.0, bootstrap=[1.0, 2.0])
    with pytest.raises(TypeError, match="bootstrap must be a floating-point"):
        gae(r, v, gamma=1.0, lam=1.0, bootstrap=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"bootstrap must have shape \[B\] = \[2\]"):
        gae(r, v, gamma=1.0, lam=1.0, bootstrap=torch.zeros(3))
    with pytest.raises(ValueError, match=r"bootstrap must have shape"):
        discounted_returns(r, gamma=1.0, bootstrap=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="truncated needs bootstrap="):
        gae(r, v, gamma=1.0, lam=1.0, truncated=torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"truncated needs a per-token bootstrap \[B, T\]"):
        discounted_returns(
            r, gamma=1.0, bootstrap=torch.zeros(2), truncated=torch.zeros(2, 5, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match=r"a per-token bootstrap \[B, T\] needs truncated="):
        gae(r, v, gamma=1.0, lam=1.0, bootstrap=torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"truncated must have shape \[2, 5\]"):
        gae(r, v, gamma=1.0, lam=1.0, bootstrap=torch.zeros(2, 5), truncated=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="truncated must hold only 0 and 1"):
        gae(r, v, gamma=1.0, lam=1.0, bootstrap=torch.zeros(2, 5), truncated=torch.full((2, 5), 2))
    with pytest.raises(ValueError, match="cp_layout must be one of"):
        gae(r, v, gamma=1.0, lam=1.0, cp_layout="ring")
    with pytest.raises(ValueError, match=r"requires grad|gradient"):
        gae(
            r,
            v,
            gamma=1.0,
            lam=1.0,
            bootstrap=torch.zeros(2, requires_grad=True),
            method="compiled",
        )


NB, NT = 3, 6  # the batch of the bad-input calls


def bad_call(fn, **kw):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(NB, NT, generator=g)
    if fn == "gae":
        return gae(rewards, torch.randn(NB, NT, generator=g), gamma=0.9, lam=0.95, **kw)
    return discounted_returns(rewards, gamma=0.9, **kw)


ONES = torch.ones(NB, NT)
NO_CUT = torch.zeros(NB, NT, dtype=torch.bool)
FLOAT = "floating-point tensor"
# (keywords, exception, the argument named, words of what it accepts)
BAD = [
    ({"bootstrap": torch.ones(NB, dtype=torch.long)}, TypeError, "bootstrap", FLOAT),
    ({"bootstrap": torch.ones(NB, dtype=torch.bool)}, TypeError, "bootstrap", FLOAT),
    ({"bootstrap": torch.ones(NB, dtype=torch.complex64)}, TypeError, "bootstrap", FLOAT),
    ({"bootstrap": torch.ones(NB + 1)}, ValueError, "bootstrap", "[B] = [3]"),
    ({"bootstrap": torch.ones(NB, 1)}, ValueError, "bootstrap", "[B, T] = [3, 6]"),
    ({"bootstrap": torch.tensor(1.0)}, ValueError, "bootstrap", "[B] = [3]"),
    ({"bootstrap": [1.0] * NB}, TypeError, "bootstrap", "torch.Tensor or None"),
    ({"bootstrap": 1.0}, TypeError, "bootstrap", "torch.Tensor or None"),
    ({"bootstrap": torch.ones(NB, device="meta")}, ValueError, "bootstrap", "one device"),
    ({"bootstrap": ONES}, ValueError, "truncated", "needs truncated="),
    ({"truncated": NO_CUT}, ValueError, "truncated", "needs bootstrap="),
    ({"bootstrap": torch.ones(NB), "truncated": NO_CUT}, ValueError, "truncated", "[B, T]"),
    (
        {"bootstrap": ONES, "truncated": torch.full((NB, NT), 0.5)},
        ValueError,
        "truncated",
        "only 0 and 1",
    ),
    (
        {"bootstrap": ONES, "truncated": torch.full((NB, NT), math.nan)},
        ValueError,
        "truncated",
        "only 0 and 1",
    ),
    (
        {"bootstrap": ONES, "truncated": 2 * torch.ones(NB, NT, dtype=torch.long)},
        ValueError,
        "truncated",
        "only 0 and 1",
    ),
    ({"bootstrap": ONES, "truncated": NO_CUT[:, :-1]}, ValueError, "truncated", "[3, 6]"),
    ({"bootstrap": ONES, "truncated": NO_CUT.to(torch.complex64)}, TypeError, "truncated", "0/1"),
    ({"bootstrap": ONES, "truncated": NO_CUT.tolist()}, TypeError, "truncated", "torch.Tensor"),
    ({"bootstrap": ONES.long(), "truncated": NO_CUT}, TypeError, "bootstrap", FLOAT),
    ({"cp_layout": "diagonal"}, ValueError, "cp_layout", "'zigzag', 'contiguous'"),
    ({"cp_layout": None}, ValueError, "cp_layout", "'zigzag', 'contiguous'"),
    ({"cp_layout": 0}, ValueError, "cp_layout", "'zigzag', 'contiguous'"),
    ({"cp_layout": "Zigzag"}, ValueError, "cp_layout", "'zigzag', 'contiguous'"),
]


@pytest.mark.parametrize("fn", ["gae", "discounted_returns"])
@pytest.mark.parametrize(
    ("kw", "exc", "arg", "words"), BAD, ids=[f"{'+'.join(k)}-{i}" for i, (k, *_) in enumerate(BAD)]
)
def test_bad_bootstrap_truncated_or_layout_raises_naming_it(fn, kw, exc, arg, words):
    with pytest.raises(exc, match=names(arg)) as info:
        bad_call(fn, **kw)
    assert words in str(info.value)


@pytest.mark.parametrize("fn", ["gae", "discounted_returns"])
def test_nan_bootstrap_reaches_its_row_and_no_other(fn):
    # a NaN bootstrap is data, not an error: it reaches its own row (through a nonzero
    # discount) and no other
    boot = torch.tensor([0.0, math.nan, 1.0])
    out = bad_call(fn, bootstrap=boot)
    ret = out[1] if isinstance(out, tuple) else out
    assert ret[1].isnan().all()
    assert torch.isfinite(ret[[0, 2]]).all()


@pytest.mark.parametrize("fn", ["gae", "discounted_returns"])
def test_valid_values_run(fn):
    for kw in (
        {"bootstrap": torch.ones(NB)},
        {"bootstrap": ONES, "truncated": NO_CUT | True},
        {"bootstrap": ONES, "truncated": torch.zeros(NB, NT, dtype=torch.long)},
        {"cp_layout": "contiguous"},
    ):
        out = bad_call(fn, **kw)
        ret = out[1] if isinstance(out, tuple) else out
        assert torch.isfinite(ret).all()


# --------------------------------------------------------------------------- property


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    B=st.integers(1, 3),
    T=st.integers(1, 24),
    gamma=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    lam=st.sampled_from([0.0, 0.7, 1.0]),
    form=st.sampled_from(FORMS),
)
def test_property_every_method_equals_the_oracle(data, B, T, gamma, lam, form):
    bits = st.lists(st.booleans(), min_size=B * T, max_size=B * T)
    mask = torch.tensor(data.draw(bits)).reshape(B, T)
    dones = torch.tensor(data.draw(bits)).reshape(B, T) & torch.tensor(data.draw(bits)).reshape(
        B, T
    )
    floats = st.lists(st.floats(-4, 4), min_size=B * T, max_size=B * T)
    r = torch.tensor(data.draw(floats), dtype=torch.float64).reshape(B, T)
    v = torch.tensor(data.draw(floats), dtype=torch.float64).reshape(B, T)
    if form == "row":
        boot = torch.tensor(data.draw(floats)[:B], dtype=torch.float64)
        trunc = None
    else:
        boot = torch.tensor(data.draw(floats), dtype=torch.float64).reshape(B, T)
        trunc = torch.tensor(data.draw(bits)).reshape(B, T)
    adv_o, ret_o = gae_bootstrap_oracle(r, v, gamma, lam, mask, dones, boot, trunc)
    g_o = discounted_returns_bootstrap_oracle(r, gamma, mask, dones, boot, trunc)
    for method in ALL_METHODS:
        adv, ret = gae(r, v, gamma=gamma, lam=lam, mask=mask, dones=dones, bootstrap=boot,
                       truncated=trunc, method=method)  # fmt: skip
        g = discounted_returns(r, gamma=gamma, mask=mask, dones=dones, bootstrap=boot,
                               truncated=trunc, method=method)  # fmt: skip
        for got, want in ((adv, adv_o), (ret, ret_o), (g, g_o)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=method)


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.slow
def test_bootstrap_under_torch_compile_fullgraph():
    """Both forms traced with ``fullgraph=True``, forward (the chunked row, traced) equal to
    eager (the compiled row): the bootstrap's gradient is checked eagerly above."""
    g = torch.Generator().manual_seed(5)
    B, T = 3, 24
    f64 = dict(generator=g, dtype=torch.float64)
    r, v = torch.randn(B, T, **f64), torch.randn(B, T, **f64)
    mask = torch.rand(B, T, generator=g) > 0.3
    dones = torch.rand(B, T, generator=g) > 0.9
    trunc = torch.rand(B, T, generator=g) > 0.9
    boot_r, boot_t = torch.randn(B, **f64), torch.randn(B, T, **f64)

    def f(r, v, boot_r, boot_t):
        a, ret = gae(r, v, gamma=0.99, lam=0.95, mask=mask, dones=dones, bootstrap=boot_r)
        g = discounted_returns(r, gamma=0.9, mask=mask, dones=dones, bootstrap=boot_t,
                               truncated=trunc)  # fmt: skip
        return a.sum() + ret.square().sum() + g.square().sum()

    compiled = torch.compile(f, fullgraph=True)
    # the same sums in float64, possibly reordered
    torch.testing.assert_close(compiled(r, v, boot_r, boot_t), f(r, v, boot_r, boot_t),
                               rtol=1e-12, atol=1e-12)  # fmt: skip
