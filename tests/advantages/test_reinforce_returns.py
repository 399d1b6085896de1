"""REINFORCE++ token returns: the outcome reaches every earlier action, discounted once per
action step, with mask-0 spans skipped (not reset)."""

from __future__ import annotations

import pytest
import torch
from tests.oracles import discounted_returns_oracle
from tests.tolerances import ALL_METHODS, assert_within_reference, for_each_method

import rlops


def _formula(outcome, kl, mask, kl_coef, gamma):
    """The definition on each row's compacted action tokens, in Python floats."""
    out = torch.zeros(kl.shape, dtype=torch.float64)
    for b in range(kl.shape[0]):
        idx = [t for t in range(kl.shape[1]) if mask[b, t]]
        if not idx:
            continue
        r = [-kl_coef * float(kl[b, t]) for t in idx]
        r[-1] += float(outcome[b])
        g = float(gamma[b]) if isinstance(gamma, torch.Tensor) else gamma
        running = 0.0
        for k in reversed(range(len(idx))):
            running = r[k] + g * running
            out[b, idx[k]] = running
    return out


def _inputs(b, t_len, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    kl = torch.randn(b, t_len, generator=g, dtype=dtype).abs() * 0.1
    outcome = torch.randn(b, generator=g, dtype=dtype)
    mask = torch.rand(b, t_len, generator=g) > 0.3
    if t_len > 6:
        mask[:, t_len // 4 : t_len // 2] = False  # an interior tool span
        mask[:, -3:] = False  # right padding
    mask[0] = False  # a row with no action token
    return outcome, kl, mask


@pytest.mark.parametrize("t_len", [1, 7, 128, 129, 1000])
@pytest.mark.parametrize("gamma", [0.0, 0.95, 1.0, "per-row"])
def test_matches_the_formula_on_compacted_actions(t_len, gamma):
    outcome, kl, mask = _inputs(3, t_len, seed=t_len)
    if gamma == "per-row":
        gamma = torch.tensor([0.5, 0.9, 1.0], dtype=torch.float64)
    want = _formula(outcome, kl, mask, 0.05, gamma)

    def check(method):
        got = rlops.reinforce_plus_plus_returns(
            outcome, kl, mask, kl_coef=0.05, gamma=gamma, method=method
        )
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    for_each_method(check)


def test_float32_error_is_that_of_the_serial_reference():
    outcome, kl, mask = _inputs(3, 4097, seed=1, dtype=torch.float32)
    token_r = torch.where(mask, -0.1 * kl.double(), 0.0)
    last = (mask.shape[1] - 1) - mask.flip(-1).to(torch.uint8).argmax(-1)
    token_r[1:, :].scatter_add_(1, last[1:, None], outcome[1:, None].double())
    oracle = discounted_returns_oracle(token_r, 0.99, mask=mask)
    ref = rlops.reinforce_plus_plus_returns(
        outcome, kl, mask, kl_coef=0.1, gamma=0.99, method="reference"
    )
    for method in ALL_METHODS:
        got = rlops.reinforce_plus_plus_returns(
            outcome, kl, mask, kl_coef=0.1, gamma=0.99, method=method
        )
        assert got.dtype == torch.float32
        assert_within_reference(method, got, oracle, ref)


def test_tool_span_is_skipped_not_reset():
    kl = torch.zeros(1, 6, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
    got = rlops.reinforce_plus_plus_returns(
        torch.tensor([1.0], dtype=torch.float64), kl, mask, kl_coef=0.1, gamma=0.5
    )
    # actions at 0, 1, 4: the outcome sits on token 4 and reaches 1 and 0 once per action step
    assert got.tolist() == [[0.25, 0.5, 0.0, 0.0, 1.0, 0.0]]


def test_rows_without_actions_and_bf16():
    outcome, kl, mask = _inputs(3, 50, seed=3)
    got = rlops.reinforce_plus_plus_returns(
        outcome.bfloat16(), kl.bfloat16(), mask, kl_coef=0.1, gamma=1.0
    )
    assert got.dtype == torch.bfloat16
    assert (got[0] == 0).all() and (got[~mask] == 0).all()
    want = _formula(outcome.bfloat16().double(), kl.bfloat16().double(), mask, 0.1, 1.0)
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=2**-7 * want.abs().max())


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        (dict(rewards=torch.zeros(2)), ValueError, "rewards"),
        (dict(rewards=torch.zeros(3, dtype=torch.long)), TypeError, "rewards"),
        (dict(kl=torch.zeros(3, 4, 1)), ValueError, "kl"),
        (dict(mask=torch.ones(3, 5)), ValueError, "mask"),
        (dict(mask=None), TypeError, "mask"),
        (dict(kl_coef=-0.1), ValueError, "kl_coef"),
        (dict(gamma=1.5), ValueError, "gamma"),
        (dict(gamma=float("nan")), ValueError, "gamma"),
        (dict(method="fast"), ValueError, "method"),
    ],
)
def test_bad_input(kwargs, error, name):
    args = dict(
        rewards=torch.zeros(3), kl=torch.zeros(3, 4), mask=torch.ones(3, 4), kl_coef=0.1, gamma=1.0
    )
    args.update(kwargs)
    with pytest.raises(error, match=name):
        rlops.reinforce_plus_plus_returns(
            args.pop("rewards"), args.pop("kl"), args.pop("mask"), **args
        )
