"""The fused bfloat16 kernels of masked GAE and REINFORCE++ returns (CPU, numba): one pass over
the bfloat16 bits, bit for bit what the two-pass forms give.

* Masked GAE (with dones, truncation cuts, a bootstrap): the float32 kernel on float32 copies,
  rounded to bfloat16 (``adv`` and ``ret = adv + v`` rounded from float32 each).
* REINFORCE++ returns: the token rewards written in bfloat16 by torch (``-kl_coef * kl``
  rounded, then the outcome added on the row's last action token and rounded again), then the
  bfloat16 returns kernel over them.

At every width 1, 127, 128, 129, 1000 and 1 to 9 rows; masks with holes, right padding and
all-zero rows; gamma 0 and 1 and between.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.tolerances import needs_numba

import rlops
from rlops.advantages import compiled
from rlops.advantages._masking import GaeInputs

pytestmark = needs_numba
BF16 = torch.bfloat16
WIDTHS = [1, 127, 128, 129, 1000]
ROWS = range(1, 10)


def _mask(b, t, g, kind):
    if kind == "holes":
        mask = torch.rand(b, t, generator=g) < 0.7
    else:  # right padding
        mask = torch.arange(t) < torch.randint(0, t + 1, (b, 1), generator=g)
    mask[b // 2] = False  # an all-zero row
    return mask


def _gae_call(b, t, seed, kind, gamma, lam, ends):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(b, t, generator=g).to(BF16)
    v = torch.randn(b, t, generator=g).to(BF16)
    dones = cut = end = None
    if ends != "none":
        dones = torch.rand(b, t, generator=g) < 0.05
    if ends == "cut":  # the value after a truncation, 0 after a termination
        truncated = dones & (torch.rand(b, t, generator=g) < 0.5)
        cut = torch.where(truncated, torch.randn(b, t, generator=g), 0.0)
    if ends == "bootstrap":
        end = torch.randn(b, generator=g)
    call = GaeInputs(r, v, _mask(b, t, g, kind), dones, gamma, gamma * lam, cut, end)
    return call.per_row(torch.float64)


def _widened(call):
    """The masked bfloat16 GAE as two passes: the float32 kernel on float32 copies, rounded."""
    adv, ret = compiled.gae_compiled(call.widened())
    assert adv.dtype == torch.float32
    return adv.to(BF16), ret.to(BF16)


@pytest.mark.parametrize("t", WIDTHS)
@pytest.mark.parametrize("kind", ["holes", "right padding"])
@pytest.mark.parametrize("ends", ["none", "dones", "cut", "bootstrap"])
def test_masked_gae_is_the_float32_kernel_rounded(t, kind, ends):
    for b in ROWS:
        for gamma, lam in ((0.0, 0.95), (1.0, 1.0), (0.99, 0.95), (0.7, 0.0)):
            call = _gae_call(b, t, b * 1000 + t, kind, gamma, lam, ends)
            want = _widened(call)
            adv, ret = compiled.gae_compiled(call)
            assert adv.dtype == ret.dtype == BF16
            assert torch.equal(adv, want[0]) and torch.equal(ret, want[1])


def test_masked_gae_nan_and_inf_stay_where_they_reach():
    call = _gae_call(4, 64, 3, "holes", 1.0, 0.9, "none")
    call.rewards[0, 10], call.values[1, 20] = float("nan"), float("inf")
    call.rewards[2, 5] = float("nan")
    call.mask[2, 5] = False  # a mask-0 token's reward is never read into the carry
    adv, ret = compiled.gae_compiled(call)
    want_adv, want_ret = _widened(call)
    for got, want in ((adv, want_adv), (ret, want_ret)):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    assert not adv[2].isnan().any()


def test_public_masked_gae_takes_the_fused_kernel(monkeypatch):
    from rlops.scan import tiles

    calls = []

    def spy(*args, kernel=tiles.gae):
        calls.append(tuple(getattr(a, "dtype", None) for a in args[:3]))
        return kernel(*args)

    monkeypatch.setattr(tiles, "gae", spy)
    call = _gae_call(5, 129, 0, "holes", 0.99, 0.95, "none")
    r, v, mask = call.rewards, call.values, call.mask
    adv, ret = rlops.gae(r, v, gamma=0.99, lam=0.95, mask=mask)
    # one call on the bits, never the float32 composition
    assert calls == [(np.dtype(np.uint16), np.dtype(np.uint16), np.dtype(np.bool_))]
    adv32, ret32 = rlops.gae(r.float(), v.float(), gamma=0.99, lam=0.95, mask=mask)
    assert torch.equal(adv, adv32.to(BF16)) and torch.equal(ret, ret32.to(BF16))


def _two_pass(outcome, kl, mask, kl_coef, gamma):
    """REINFORCE++ returns from the token rewards torch writes in bfloat16."""
    reward = torch.where(mask, -kl_coef * kl, 0.0)
    last = mask.shape[1] - 1 - mask.flip(-1).to(torch.uint8).argmax(-1)
    rows = mask.any(-1).nonzero().squeeze(-1)
    reward[rows, last[rows]] += outcome[rows]  # rounded to bfloat16 again
    assert reward.dtype == BF16
    return rlops.discounted_returns(reward, gamma=gamma, mask=mask, method="compiled")


def _reinforce_inputs(b, t, seed, kind):
    g = torch.Generator().manual_seed(seed)
    kl = (torch.randn(b, t, generator=g) * torch.rand(b, 1, generator=g)).to(BF16)
    outcome = torch.randn(b, generator=g).to(BF16)
    return outcome, kl, _mask(b, t, g, kind)


@pytest.mark.parametrize("t", WIDTHS)
@pytest.mark.parametrize("kind", ["holes", "right padding"])
def test_reinforce_returns_are_the_bfloat16_token_rewards_scanned(t, kind):
    for b in ROWS:
        outcome, kl, mask = _reinforce_inputs(b, t, b * 1000 + t, kind)
        for kl_coef in (0.0, 0.05, 0.0123, 1.7):
            for gamma in (1.0, 0.99, "per-row"):
                if gamma == "per-row":
                    gamma = torch.linspace(0.3, 1.0, b, dtype=torch.float64)
                want = _two_pass(outcome, kl, mask, kl_coef, gamma)
                got = rlops.reinforce_plus_plus_returns(
                    outcome, kl, mask, kl_coef=kl_coef, gamma=gamma
                )
                assert got.dtype == BF16 and torch.equal(got, want)


@pytest.mark.parametrize("t", WIDTHS)
def test_reinforce_kernel_at_gamma_zero(t):
    # zero discounts are routed to the two-pass form; the kernel itself gives the same bits
    for b in ROWS:
        outcome, kl, mask = _reinforce_inputs(b, t, b + t, "holes")
        gamma = torch.zeros(b, dtype=torch.float64)
        got = compiled.reinforce_returns_compiled(kl, outcome, mask, 0.1, gamma)
        public = rlops.reinforce_plus_plus_returns(outcome, kl, mask, kl_coef=0.1, gamma=0.0)
        want = _two_pass(outcome, kl, mask, 0.1, 0.0)
        assert torch.equal(got, want) and torch.equal(public, want)


def test_reinforce_nan_on_mask0_tokens_and_empty_rows_stay_out():
    outcome, kl, mask = _reinforce_inputs(4, 64, 2, "holes")
    want = _two_pass(outcome, kl, mask, 0.1, 0.95)
    kl[~mask] = float("nan")
    outcome[mask.shape[0] // 2] = float("inf")  # the all-zero row has no outcome token
    got = rlops.reinforce_plus_plus_returns(outcome, kl, mask, kl_coef=0.1, gamma=0.95)
    assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.parametrize("t", [47, 1043])
def test_reinforce_tiles_after_every_outcome_is_added(t):
    """The kernel skips the second rounding on tiles where every row's outcome is added
    already (or is ±0): rows whose last action token falls at each position around a tile's
    edges, outcomes of +0, -0, NaN and ordinary values, give the two-pass bits."""
    b = 16
    outcome, kl, _ = _reinforce_inputs(b, t, t, "holes")
    outcome[0], outcome[1], outcome[2] = 0.0, -0.0, float("nan")
    ends = torch.tensor([t - 1, t - 2, t - 15, t - 16, t - 17, t - 33, 16, 15] * 2)[:b]
    mask = torch.arange(t) <= ends.clamp(0, t - 1).unsqueeze(-1)
    mask[8:, ::3] = False  # holes in half the rows
    want = _two_pass(outcome, kl, mask, 0.1, 0.97)
    got = rlops.reinforce_plus_plus_returns(outcome, kl, mask, kl_coef=0.1, gamma=0.97)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(
        got.nan_to_num(0.0).view(torch.int16), want.nan_to_num(0.0).view(torch.int16)
    )
