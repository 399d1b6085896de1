"""``rlops.gae`` and ``rlops.discounted_returns`` against the compacting oracles, and identities.

Masks have interior mask-0 spans (tool output), right padding and rows with no action token;
dones fall anywhere, mask-0 tokens included. Tolerances as in ``tests/tolerances.py``.
"""

from __future__ import annotations

import functools
import itertools
import zlib

import numpy as np
import pytest
import torch
from tests.oracles import (
    EXTENDED,
    discounted_returns_oracle,
    gae_oracle,
    reversed_cumsum_oracle,
)
from tests.tolerances import (
    FAST_METHODS,
    METHODS,
    assert_half_matches,
    assert_within_bound,
    assert_within_reference,
    for_each_method,
    needs_numba,
    serial_bound,
)

from rlops import discounted_cumsum, discounted_returns, gae

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
HALF = (torch.bfloat16, torch.float16)
SIZES = [(1, 1), (3, 1), (1, 127), (3, 128), (3, 129), (3, 1000), (3, 4097)]  # (B, T)
# T = 4097 runs in float32 only: the serial reference takes ~0.2 s a case there, and long-range
# accuracy is a float32 question (float64 and bfloat16 are covered up to T = 1000).
LONG = (3, 4097)
SCENARIOS = ["plain", "mask", "dones", "mask+dones"]
# (gamma, lam); "per-row" gives each row its own gamma and lam (tensors [B])
DISCOUNTS = {"1-0.95": (1.0, 0.95), "0.99-0.95": (0.99, 0.95), "0.9405-1": (0.9405, 1.0)}
PER_ROW = "per-row"


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def random_mask(B, T, rng) -> torch.Tensor:
    """Responses with tool-output spans inside (mask 0) and right padding.

    Row 0 spans the full length; row 1 is right padded; row 2 has no action token; later rows
    are random. Span lengths are geometric (actions ~ 24 tokens, tool outputs ~ 9).
    """
    mask = np.zeros((B, T), dtype=bool)
    for b in range(B):
        if b == 2:
            continue
        length = T if b == 0 else int(rng.integers(0, T + 1))
        t, action = 0, bool(rng.integers(0, 2)) or T < 4
        while t < length:
            span = int(rng.geometric(1 / 24 if action else 1 / 9))
            mask[b, t : min(t + span, length)] = action
            t += span
            action = not action
    return torch.from_numpy(mask)


def random_dones(B, T, rng, mask=None) -> torch.Tensor:
    """Episode ends on ~2% of tokens, plus one on a mask-0 token of each row that has one."""
    dones = rng.random((B, T)) < 0.02
    if mask is not None:
        for b in range(B):
            off = np.flatnonzero(~mask[b].numpy())
            if off.size:
                dones[b, rng.choice(off)] = True
    return torch.from_numpy(dones)


def make_batch(B, T, scenario, dtype, seed):
    rng = np.random.default_rng(seed)
    rewards = torch.from_numpy(rng.standard_normal((B, T))).to(dtype)
    values = torch.from_numpy(rng.standard_normal((B, T))).to(dtype)
    mask = random_mask(B, T, rng) if "mask" in scenario else None
    dones = random_dones(B, T, rng, mask) if "dones" in scenario else None
    return rewards, values, mask, dones


def make_discounts(name, B):
    if name == PER_ROW:
        gamma = torch.tensor([1.0, 0.99, 0.9405, 0.5])[torch.arange(B) % 4]
        lam = torch.tensor([0.95, 1.0, 0.0, 0.9])[torch.arange(B) % 4]
        return gamma, lam
    return DISCOUNTS[name]


def _full(dtype):
    return torch.float32 if dtype in HALF else dtype


@functools.lru_cache(maxsize=16)
def gae_case(B, T, scenario, dtype_name, discounts):
    """Inputs, the oracle's (advantages, returns) and the serial reference's outputs (in float32
    for half dtypes)."""
    dtype = DTYPES[dtype_name]
    rewards, values, mask, dones = make_batch(B, T, scenario, dtype, _seed(B, T, scenario))
    gamma, lam = make_discounts(discounts, B)
    oracle = gae_oracle(rewards, values, gamma, lam, mask, dones, extended=EXTENDED)
    full = _full(dtype)
    ref = gae(
        rewards.to(full), values.to(full), gamma=gamma, lam=lam, mask=mask, dones=dones,
        method="reference",
    )  # fmt: skip
    return (rewards, values, mask, dones, gamma, lam), oracle, ref


def _abs_scale(rewards, values, gamma, lam, mask, dones):
    """An upper bound on the sum of |terms| behind every output: the scan (discount gamma * lam)
    of |r| + 2 max|V| over the compacted sequences, plus |V| for the returns."""
    g = gamma if isinstance(gamma, float) else gamma.double()
    gl = g * (lam if isinstance(lam, float) else lam.double())
    vmax = float(values.abs().max()) if values.numel() else 0.0
    x = rewards.double().abs() + 2 * vmax
    scale = discounted_returns_oracle(x, gl, mask, dones, extended=EXTENDED)
    return scale, scale + np.abs(values.double().numpy())


def check_estimate(name, out, oracle, ref, method, steps, abs_scale):
    dtype = out.dtype
    if dtype in HALF:
        assert_half_matches(name, out, ref, oracle)
    elif method == "reference" or (dtype == torch.float64 and not EXTENDED):
        bound = serial_bound(steps + 2, dtype, abs_scale)
        assert_within_bound(f"{name} (a priori bound of the serial loop)", out, oracle, bound)
    else:
        assert_within_reference(name, out, oracle, ref)


GAE_GRID = [
    pytest.param((B, T, scenario, dt, disc), id=f"{dt}-{scenario}-{disc}-T{T}-B{B}")
    for dt, scenario, disc, (B, T) in itertools.product(
        DTYPES, SCENARIOS, [*DISCOUNTS, PER_ROW], SIZES
    )
    if (B, T) != LONG or dt == "float32"
]


@pytest.mark.parametrize("case", GAE_GRID)
def test_gae_matches_oracle(case):
    (rewards, values, mask, dones, gamma, lam), (adv_o, ret_o), (adv_r, ret_r) = gae_case(*case)
    scale_a, scale_r = _abs_scale(rewards, values, gamma, lam, mask, dones)
    T = rewards.shape[1]

    def check(method):
        adv, ret = gae(
            rewards, values, gamma=gamma, lam=lam, mask=mask, dones=dones, method=method
        )  # fmt: skip
        for out in (adv, ret):
            assert out.dtype == rewards.dtype and out.shape == rewards.shape
        if mask is not None:
            off = ~mask
            assert (adv[off] == 0).all() and (ret[off] == 0).all(), "nonzero on mask-0 tokens"
        check_estimate(f"{case} advantages", adv, adv_o, adv_r, method, T, scale_a)
        check_estimate(f"{case} returns", ret, ret_o, ret_r, method, T, scale_r)

    for_each_method(check)


RETURNS_GRID = [
    pytest.param((B, T, scenario, dt, disc), id=f"{dt}-{scenario}-{disc}-T{T}-B{B}")
    for dt, scenario, disc, (B, T) in itertools.product(
        DTYPES, SCENARIOS, ["0.99-0.95", PER_ROW], SIZES
    )
    if (B, T) != LONG or dt == "float32"
]


@functools.lru_cache(maxsize=16)
def returns_case(B, T, scenario, dtype_name, discounts):
    dtype = DTYPES[dtype_name]
    rewards, _, mask, dones = make_batch(B, T, scenario, dtype, _seed(B, T, scenario))
    gamma, _ = make_discounts(discounts, B)
    oracle = discounted_returns_oracle(rewards, gamma, mask, dones, extended=EXTENDED)
    ref = discounted_returns(
        rewards.to(_full(dtype)), gamma=gamma, mask=mask, dones=dones, method="reference"
    )
    return (rewards, mask, dones, gamma), oracle, ref


@pytest.mark.parametrize("case", RETURNS_GRID)
def test_discounted_returns_matches_oracle(case):
    (rewards, mask, dones, gamma), oracle, ref = returns_case(*case)
    scale = discounted_returns_oracle(rewards.double().abs(), gamma, mask, dones, extended=EXTENDED)

    def check(method):
        out = discounted_returns(rewards, gamma=gamma, mask=mask, dones=dones, method=method)
        assert out.dtype == rewards.dtype and out.shape == rewards.shape
        if mask is not None:
            assert (out[~mask] == 0).all(), "nonzero on mask-0 tokens"
        check_estimate(str(case), out, oracle, ref, method, rewards.shape[1], scale)

    for_each_method(check)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, None])
@pytest.mark.parametrize("T", [127, 129, 1000])
@pytest.mark.parametrize("scenario", ["plain", "mask+dones"])
def test_gae_chunk_sizes(scenario, T, chunk_size):
    (rewards, values, mask, dones, gamma, lam), (adv_o, ret_o), (adv_r, ret_r) = gae_case(
        3, T, scenario, "float32", PER_ROW
    )
    adv, ret = gae(
        rewards, values, gamma=gamma, lam=lam, mask=mask, dones=dones, method="chunked",
        chunk_size=chunk_size,
    )  # fmt: skip
    assert_within_reference(f"chunk_size={chunk_size} advantages", adv, adv_o, adv_r)
    assert_within_reference(f"chunk_size={chunk_size} returns", ret, ret_o, ret_r)


# ---------------------------------------------------------------------------------- identities


def _identity_batch(seed, B=4, T=700, dtype=torch.float64):
    return make_batch(B, T, "mask+dones", dtype, seed)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("gamma", [1.0, 0.99, "per-row"])
def test_lambda_one_gives_discounted_returns(method, gamma):
    """lambda = 1: advantages + values == discounted returns of the rewards, on action tokens
    (the values telescope away). Both sides in float64, each within the serial loop's bound."""
    rewards, values, mask, dones = _identity_batch(11)
    if gamma == "per-row":
        gamma = torch.tensor([1.0, 0.99, 0.5, 0.0], dtype=torch.float64)
    adv, _ = gae(rewards, values, gamma=gamma, lam=1.0, mask=mask, dones=dones, method=method)
    ret = discounted_returns(rewards, gamma=gamma, mask=mask, dones=dones, method=method)
    lhs = torch.where(mask, adv + values, 0.0)
    _, scale = _abs_scale(rewards, values, gamma, 1.0, mask, dones)
    bound = 2 * serial_bound(rewards.shape[1] + 2, torch.float64, scale)
    assert_within_bound("A + V vs G", lhs, ret, bound)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gamma_zero(method, dtype):
    """gamma = 0: A = r - V and G = r exactly (every discounted term vanishes)."""
    rewards, values, mask, dones = _identity_batch(12, dtype=dtype)
    for lam in (0.95, 0.0, 1.0):
        adv, _ = gae(rewards, values, gamma=0.0, lam=lam, mask=mask, dones=dones, method=method)
        full = _full(dtype)
        expected = (rewards.to(full) - values.to(full)).to(dtype)
        assert torch.equal(adv, torch.where(mask, expected, 0.0)), f"lam={lam}"
    ret = discounted_returns(rewards, gamma=0.0, mask=mask, dones=dones, method=method)
    assert torch.equal(ret, torch.where(mask, rewards, 0.0))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_on_mask_zero_tokens_are_ignored(method, dtype):
    """Rewards (and values) on mask-0 tokens never enter the result: whatever they hold (large
    values, NaN or inf padding), the outputs are the same bit for bit."""
    rewards, values, mask, dones = _identity_batch(13, dtype=dtype)
    off = ~mask
    noise = torch.randn(rewards.shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    kw = {"gamma": 0.99, "mask": mask, "dones": dones, "method": method}
    adv, ret = gae(rewards, values, lam=0.95, **kw)
    g = discounted_returns(rewards, **kw)
    for fill in (
        1e4 * noise,
        torch.full_like(noise, float("nan")),
        torch.full_like(noise, -float("inf")),
    ):
        rewards2 = torch.where(off, fill, rewards)
        values2 = torch.where(off, -fill, values)
        adv2, ret2 = gae(rewards2, values, lam=0.95, **kw)
        adv3, ret3 = gae(rewards, values2, lam=0.95, **kw)
        what = f"fill {fill.flatten()[0].item()}"
        assert torch.equal(adv, adv2) and torch.equal(ret, ret2), f"rewards on mask-0 used, {what}"
        assert torch.equal(adv, adv3) and torch.equal(ret, ret3), f"values on mask-0 used, {what}"
        assert torch.equal(g, discounted_returns(rewards2, **kw)), (
            f"rewards on mask-0 tokens used by discounted_returns, {what}"
        )


@pytest.mark.parametrize("method", METHODS)
def test_done_cuts_the_flow(method):
    """Nothing after a done reaches the tokens up to it: rewriting every input after the done
    (a done on a mask-0 token included) leaves the earlier outputs bit for bit unchanged."""
    rewards, values, mask, _ = _identity_batch(14, B=3, T=400, dtype=torch.float32)
    mask[:, 190:210] = False
    cuts = [150, 199, 200]  # row 0: on an action token (if any); rows 1, 2: inside a tool span
    dones = torch.zeros_like(mask)
    for b, t in enumerate(cuts):
        dones[b, t] = True
    gen = torch.Generator().manual_seed(1)
    rewards2, values2 = rewards.clone(), values.clone()
    for b, t in enumerate(cuts):
        rewards2[b, t + 1 :] = torch.randn(400 - t - 1, generator=gen)
        values2[b, t + 1 :] = torch.randn(400 - t - 1, generator=gen)
    kw = {"mask": mask, "dones": dones, "method": method}
    adv, ret = gae(rewards, values, gamma=1.0, lam=0.95, **kw)
    adv2, ret2 = gae(rewards2, values2, gamma=1.0, lam=0.95, **kw)
    g, g2 = (
        discounted_returns(rewards, gamma=1.0, **kw),
        discounted_returns(rewards2, gamma=1.0, **kw),
    )
    for b, t in enumerate(cuts):
        for name, u, w in (("advantages", adv, adv2), ("returns", ret, ret2), ("G", g, g2)):
            assert torch.equal(u[b, : t + 1], w[b, : t + 1]), f"{name}: row {b} done at {t}"


@pytest.mark.parametrize("method", METHODS)
def test_packed_rows_equal_separate_rows(method):
    """Two sequences packed in one row with a done between them == the two rows run apart."""
    rng = np.random.default_rng(15)
    a_len, b_len = 300, 517
    r = torch.from_numpy(rng.standard_normal((1, a_len + b_len)))
    v = torch.from_numpy(rng.standard_normal((1, a_len + b_len)))
    mask = random_mask(1, a_len + b_len, rng)
    mask[0, a_len - 5 : a_len] = False  # the first sequence ends in a tool span, done on it
    dones = torch.zeros_like(mask)
    dones[0, a_len - 1] = True
    kw = {"gamma": 0.99, "lam": 0.95, "method": method}
    adv, ret = gae(r, v, mask=mask, dones=dones, **kw)
    parts = [
        gae(r[:, s], v[:, s], mask=mask[:, s], **kw) for s in (slice(0, a_len), slice(a_len, None))
    ]
    adv_sep = torch.cat([p[0] for p in parts], dim=1)
    ret_sep = torch.cat([p[1] for p in parts], dim=1)
    scale_a, scale_r = _abs_scale(r, v, 0.99, 0.95, mask, dones)
    T = a_len + b_len
    assert_within_bound("packed advantages", adv, adv_sep, 2 * serial_bound(T, r.dtype, scale_a))
    assert_within_bound("packed returns", ret, ret_sep, 2 * serial_bound(T, r.dtype, scale_r))


@pytest.mark.parametrize("method", METHODS)
def test_right_padding_is_mask_zero(method):
    """A right-padded row gives, on its tokens, what the unpadded row gives."""
    rng = np.random.default_rng(16)
    r = torch.from_numpy(rng.standard_normal((2, 600)))
    v = torch.from_numpy(rng.standard_normal((2, 600)))
    mask = random_mask(1, 400, rng).expand(2, 400)
    kw = {"gamma": 1.0, "lam": 0.95, "method": method}
    short = gae(r[:, :400], v[:, :400], mask=mask, **kw)
    padded_mask = torch.cat([mask, torch.zeros(2, 200, dtype=torch.bool)], dim=1)
    padded = gae(r, v, mask=padded_mask, **kw)
    scale_a, scale_r = _abs_scale(r, v, 1.0, 0.95, padded_mask, None)
    for s, p, scale in zip(short, padded, (scale_a, scale_r), strict=True):
        assert (p[:, 400:] == 0).all()
        bound = 2 * serial_bound(600, torch.float64, scale[:, :400])
        assert_within_bound("right padding", p[:, :400], s, bound)


@pytest.mark.parametrize("method", METHODS)
def test_indicator_dtypes_agree(method):
    """mask as bool, int or float 0/1 and dones as bool or int give identical results."""
    rewards, values, mask, dones = _identity_batch(17, dtype=torch.float32)
    base = gae(rewards, values, gamma=0.99, lam=0.95, mask=mask, dones=dones, method=method)
    for m in (mask.long(), mask.int(), mask.float(), mask.to(torch.uint8)):
        for d in (dones, dones.long(), dones.to(torch.uint8)):
            got = gae(rewards, values, gamma=0.99, lam=0.95, mask=m, dones=d, method=method)
            assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1]), (m.dtype, d.dtype)
    g = discounted_returns(rewards, gamma=0.99, mask=mask, dones=dones, method=method)
    g2 = discounted_returns(
        rewards, gamma=0.99, mask=mask.float(), dones=dones.long(), method=method
    )
    assert torch.equal(g, g2)


@pytest.mark.parametrize("method", METHODS)
def test_all_masked_and_all_done(method):
    r = torch.randn(2, 50, dtype=torch.float64)
    v = torch.randn(2, 50, dtype=torch.float64)
    no_action = torch.zeros(2, 50, dtype=torch.bool)
    adv, ret = gae(r, v, gamma=1.0, lam=1.0, mask=no_action, method=method)
    assert (adv == 0).all() and (ret == 0).all()
    assert (discounted_returns(r, gamma=1.0, mask=no_action, method=method) == 0).all()
    # every token a done: each token is its own one-step sequence
    every = torch.ones(2, 50, dtype=torch.bool)
    adv, ret = gae(r, v, gamma=1.0, lam=1.0, dones=every, method=method)
    assert torch.equal(adv, r - v) and torch.equal(ret, v + (r - v))
    assert torch.equal(discounted_returns(r, gamma=1.0, dones=every, method=method), r)


@pytest.mark.parametrize("method", METHODS)
def test_non_contiguous_inputs(method):
    """Transposed and strided views of rewards, values, mask and dones (reference on copies)."""
    rng = np.random.default_rng(18)
    r = torch.from_numpy(rng.standard_normal((600, 3))).float().t()
    v = torch.from_numpy(rng.standard_normal((3, 1200))).float()[:, ::2]
    mask = random_mask(3, 600, rng)
    dones = random_dones(3, 600, rng, mask)
    mask_nc = torch.stack([mask, ~mask], dim=-1)[..., 0]
    dones_nc = dones.t().contiguous().t()
    for t in (r, v, mask_nc, dones_nc):
        assert not t.is_contiguous()
    kw = {"gamma": 0.99, "lam": 0.95}
    rc, vc = r.contiguous(), v.contiguous()
    adv, ret = gae(r, v, mask=mask_nc, dones=dones_nc, method=method, **kw)
    adv_r, ret_r = gae(rc, vc, mask=mask, dones=dones, method="reference", **kw)
    adv_o, ret_o = gae_oracle(r, v, 0.99, 0.95, mask, dones, extended=EXTENDED)
    scale_a, scale_r = _abs_scale(r, v, 0.99, 0.95, mask, dones)
    check_estimate("non-contiguous advantages", adv, adv_o, adv_r, method, 600, scale_a)
    check_estimate("non-contiguous returns", ret, ret_o, ret_r, method, 600, scale_r)
    g = discounted_returns(r, gamma=0.99, mask=mask_nc, dones=dones_nc, method=method)
    g_r = discounted_returns(rc, gamma=0.99, mask=mask, dones=dones, method="reference")
    g_o = discounted_returns_oracle(r, 0.99, mask, dones, extended=EXTENDED)
    scale = discounted_returns_oracle(r.double().abs(), 0.99, mask, dones, extended=EXTENDED)
    check_estimate("non-contiguous discounted returns", g, g_o, g_r, method, 600, scale)


EMPTY = [(0, 0), (3, 0), (0, 5)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("B", "T"), EMPTY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_empty_inputs(method, B, T, dtype):
    r = torch.empty(B, T, dtype=dtype)
    mask = torch.ones(B, T, dtype=torch.bool)
    dones = torch.zeros(B, T, dtype=torch.bool)
    for kw in ({}, {"mask": mask, "dones": dones}):
        adv, ret = gae(r, r, gamma=0.99, lam=0.95, method=method, **kw)
        assert adv.shape == ret.shape == (B, T) and adv.dtype == ret.dtype == dtype
        g = discounted_returns(r, gamma=0.99, method=method, **kw)
        assert g.shape == (B, T) and g.dtype == dtype


@pytest.mark.parametrize("method", METHODS)
def test_inputs_not_modified(method):
    rewards, values, mask, dones = _identity_batch(19, dtype=torch.float32)
    saved = [t.clone() for t in (rewards, values, mask, dones)]
    gae(rewards, values, gamma=0.99, lam=0.95, mask=mask, dones=dones, method=method)
    discounted_returns(rewards, gamma=0.99, mask=mask, dones=dones, method=method)
    for before, after in zip(saved, (rewards, values, mask, dones), strict=True):
        assert torch.equal(before, after)


@needs_numba
def test_compiled_splits_rows_over_threads():
    """Enough rows and tokens for the compiled kernels to split groups of rows over threads:
    every row equals the same kernel run on that row alone, bit for bit, and the serial
    kernel stays within the serial loop's a priori bound of the oracle."""
    B, T = 9, 1 << 16
    rewards, values, mask, dones = make_batch(B, T, "mask+dones", torch.float32, 21)
    kw = {"gamma": 0.99, "mask": mask, "dones": dones, "method": "compiled"}
    adv, ret = gae(rewards, values, lam=0.95, **kw)
    g = discounted_returns(rewards, **kw)
    for b in (0, 3, 4, 8):
        one = {**kw, "mask": mask[b : b + 1], "dones": dones[b : b + 1]}
        adv_b, ret_b = gae(rewards[b : b + 1], values[b : b + 1], lam=0.95, **one)
        assert torch.equal(adv[b : b + 1], adv_b) and torch.equal(ret[b : b + 1], ret_b), b
        assert torch.equal(g[b : b + 1], discounted_returns(rewards[b : b + 1], **one)), b
    adv_o, ret_o = gae_oracle(rewards, values, 0.99, 0.95, mask, dones, extended=EXTENDED)
    scale_a, scale_r = _abs_scale(rewards, values, 0.99, 0.95, mask, dones)
    assert_within_bound("advantages", adv, adv_o, serial_bound(T + 2, torch.float32, scale_a))
    assert_within_bound("returns", ret, ret_o, serial_bound(T + 2, torch.float32, scale_r))


# ------------------------------------------------------------------------ long sequences


@functools.cache
def _long_batch():
    """T = 131072, gamma = lam = 1, an outcome reward of 1e4 on the last token over small
    per-token rewards (a KL-penalty-like 0.1 * N(0, 1)), random values."""
    T = 131072
    gen = torch.Generator().manual_seed(20)
    rewards = 0.1 * torch.randn(2, T, generator=gen)
    rewards[:, -1] = 1e4
    values = torch.randn(2, T, generator=gen)
    # oracle, vectorised: delta[t] = r[t] + V[t+1] - V[t] (V = 0 past the end), A = sum_{k>=t}
    v_next = torch.cat([values[:, 1:], torch.zeros(2, 1)], dim=1)
    dt = np.longdouble if EXTENDED else np.float64
    delta = rewards.double().numpy().astype(dt) + v_next.double().numpy().astype(dt)
    delta -= values.double().numpy().astype(dt)
    adv_o = np.flip(np.cumsum(np.flip(delta, -1), -1), -1)
    ret_o = adv_o + values.double().numpy().astype(dt)
    ref = gae(rewards, values, gamma=1.0, lam=1.0, method="reference")
    g_o = reversed_cumsum_oracle(rewards, extended=EXTENDED)
    # Without mask and dones the serial returns loop is the serial scan, operation for
    # operation (G = r + gamma * G); the scan's loop is the faster of the two to run.
    g_ref = discounted_cumsum(rewards, 1.0, method="reference")
    return rewards, values, (adv_o, ret_o), ref, g_o, g_ref


def test_serial_returns_are_the_serial_scan():
    """Without mask and dones the serial returns loop is the serial scan operation for
    operation, so the long test below may take its (faster) float32 reference from the scan."""
    rewards = torch.randn(2, 3000, generator=torch.Generator().manual_seed(22))
    rewards[:, -1] = 1e4
    assert torch.equal(
        discounted_returns(rewards, gamma=1.0, method="reference"),
        discounted_cumsum(rewards, 1.0, method="reference"),
    )


@pytest.mark.slow
@pytest.mark.parametrize("method", FAST_METHODS)
def test_long_sequence_gae_at_gamma_lam_one(method):
    rewards, values, (adv_o, ret_o), (adv_r, ret_r), g_o, g_r = _long_batch()
    adv, ret = gae(rewards, values, gamma=1.0, lam=1.0, method=method)
    adv_c, ret_c = gae(rewards, values, gamma=1.0, lam=1.0, method="chunked")
    assert_within_reference(f"T=131072 {method} advantages", adv, adv_o, adv_r, chunked_out=adv_c)
    assert_within_reference(f"T=131072 {method} returns", ret, ret_o, ret_r, chunked_out=ret_c)
    g = discounted_returns(rewards, gamma=1.0, method=method)
    g_c = discounted_returns(rewards, gamma=1.0, method="chunked")
    assert_within_reference(f"T=131072 {method} discounted returns", g, g_o, g_r, chunked_out=g_c)
