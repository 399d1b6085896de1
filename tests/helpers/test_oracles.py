"""The oracles checked on their own: hand-computed cases and independent formulations.

Nothing here imports rlops; if these fail, the oracles (not the library) are wrong.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.oracles import (
    compact_sequences,
    discounted_cumsum_oracle,
    discounted_returns_oracle,
    gae_oracle,
    reversed_cumsum_oracle,
    sequence_spans,
)

F64 = torch.float64
# Two float64 formulations on O(1) data agree to ~1e-15; 1e-12 flags any real disagreement.
CLOSE = {"rtol": 1e-12, "atol": 1e-12}


def t64(rows):
    return torch.tensor(rows, dtype=F64)


def test_cumsum_hand_computed():
    x = t64([[1.0, 2.0, 3.0]])
    assert discounted_cumsum_oracle(x, 0.5).tolist() == [[2.75, 3.5, 3.0]]
    assert discounted_cumsum_oracle(x, 0.0).tolist() == [[1.0, 2.0, 3.0]]
    assert discounted_cumsum_oracle(x, 1.0).tolist() == [[6.0, 5.0, 3.0]]
    # per-token: a = [0.5, 0 (cut), 1]: y2 = 3, y1 = 2 + 0 * 3, y0 = 1 + 0.5 * 2
    assert discounted_cumsum_oracle(x, t64([[0.5, 0.0, 1.0]])).tolist() == [[2.0, 2.0, 3.0]]


def test_cumsum_dim_and_broadcast():
    x = t64([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]])  # [T=3, B=2], time on dim 0
    y = discounted_cumsum_oracle(x, t64([[0.5, 1.0]]), dim=0)
    assert y.tolist() == [[2.75, 60.0], [3.5, 50.0], [3.0, 30.0]]


def _matrix_form(x: np.ndarray, a: np.ndarray) -> np.ndarray:
    """y = W x with W[t, k] = prod_{t <= j < k} a[j] for k >= t (the closed form)."""
    n = x.shape[-1]
    w = np.zeros((n, n))
    for t in range(n):
        w[t, t] = 1.0
        for k in range(t + 1, n):
            w[t, k] = w[t, k - 1] * a[k - 1]
    return w @ x


@pytest.mark.parametrize("seed", range(5))
def test_cumsum_equals_matrix_form(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(40)
    a = rng.uniform(0, 1, 40)
    a[rng.integers(0, 40, 3)] = 0.0
    a[rng.integers(0, 40, 3)] = 1.0
    y = discounted_cumsum_oracle(torch.from_numpy(x)[None], torch.from_numpy(a)[None])[0]
    np.testing.assert_allclose(y.numpy(), _matrix_form(x, a), **CLOSE)


def test_reversed_cumsum_equals_loop_at_discount_one():
    x = torch.randn(3, 500, generator=torch.Generator().manual_seed(0), dtype=F64)
    np.testing.assert_allclose(reversed_cumsum_oracle(x), discounted_cumsum_oracle(x, 1.0), **CLOSE)


def test_sequence_spans():
    assert sequence_spans([]) == []
    assert sequence_spans([False] * 3) == [(0, 3)]
    assert sequence_spans([False, True, False]) == [(0, 2), (2, 3)]
    assert sequence_spans([False, False, True]) == [(0, 3)]
    assert sequence_spans([True, True]) == [(0, 1), (1, 2)]


def test_compact_sequences():
    mask = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    dones = torch.tensor([[0, 0, 0, 1, 0, 0], [0, 1, 0, 0, 0, 0]], dtype=torch.bool)
    assert compact_sequences(mask, dones, (2, 6)) == [[[0, 2, 3]], []]
    dones = torch.tensor([[0, 1, 0, 0, 0, 0], [0] * 6], dtype=torch.bool)  # done on a mask-0
    assert compact_sequences(mask, dones, (2, 6)) == [[[0], [2, 3]], []]


def test_gae_hand_computed():
    r, v = t64([[1.0, 2.0, 3.0]]), t64([[0.5, 0.5, 0.5]])
    # d2 = 3 - .5 = 2.5; d1 = 2 + .25 - .5 = 1.75, A1 = 1.75 + .25 * 2.5; d0 = .75, A0 = ...
    adv, ret = gae_oracle(r, v, 0.5, 0.5)
    assert adv.tolist() == [[1.34375, 2.375, 2.5]]
    assert ret.tolist() == [[1.84375, 2.875, 3.0]]

    # token 1 is not an action: skipped, so this is GAE on r = [1, 3], V = [.5, .5]
    r, v = t64([[1.0, 9.0, 3.0]]), t64([[0.5, 7.0, 0.5]])
    mask = torch.tensor([[True, False, True]])
    adv, ret = gae_oracle(r, v, 0.5, 0.5, mask=mask)
    assert adv.tolist() == [[1.375, 0.0, 2.5]]
    assert ret.tolist() == [[1.875, 0.0, 3.0]]

    # a done on the mask-0 token still cuts: token 0 is a one-step sequence
    dones = torch.tensor([[False, True, False]])
    adv, ret = gae_oracle(r, v, 0.5, 0.5, mask=mask, dones=dones)
    assert adv.tolist() == [[0.5, 0.0, 2.5]]
    assert ret.tolist() == [[1.0, 0.0, 3.0]]


def test_returns_hand_computed():
    r = t64([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    assert discounted_returns_oracle(r, 0.5).tolist() == [[2.75, 3.5, 3.0]] * 2
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]])
    dones = torch.tensor([[0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    got = discounted_returns_oracle(r, t64([0.5, 1.0]), mask=mask, dones=dones)
    assert got.tolist() == [[2.5, 0.0, 3.0], [1.0, 5.0, 3.0]]


def _scan_form_gae(r, v, gamma, lam, mask, dones):
    """GAE as one masked scan (the other formulation): a masked token passes its carry
    through; a done zeroes the carry; V[next] is the next action token's value."""
    r, v = r.numpy(), v.numpy()
    m, d = mask.numpy().astype(bool), dones.numpy().astype(bool)
    adv = np.zeros_like(r)
    for b in range(r.shape[0]):
        carry, next_value = 0.0, 0.0
        for t in reversed(range(r.shape[1])):
            if d[b, t]:
                carry, next_value = 0.0, 0.0
            if m[b, t]:
                carry = r[b, t] + gamma * next_value - v[b, t] + gamma * lam * carry
                next_value = v[b, t]
                adv[b, t] = carry
    return adv


@pytest.mark.parametrize("seed", range(10))
def test_gae_oracle_equals_scan_form(seed):
    gen = torch.Generator().manual_seed(seed)
    B, T = 4, 60
    r = torch.randn(B, T, generator=gen, dtype=F64)
    v = torch.randn(B, T, generator=gen, dtype=F64)
    mask = torch.rand(B, T, generator=gen) < 0.6
    dones = torch.rand(B, T, generator=gen) < 0.08
    adv, ret = gae_oracle(r, v, 0.97, 0.9, mask=mask, dones=dones)
    np.testing.assert_allclose(adv.numpy(), _scan_form_gae(r, v, 0.97, 0.9, mask, dones), **CLOSE)
    np.testing.assert_array_equal(ret.numpy(), np.where(mask, (adv + v).numpy(), 0.0))
    assert (adv[~mask] == 0).all()


@pytest.mark.parametrize("seed", range(5))
def test_oracles_agree_without_mask(seed):
    """No mask, no dones: GAE is the scan of the TD errors with discount gamma * lam, and
    lambda = 1 gives the discounted return minus the value."""
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(3, 50, generator=gen, dtype=F64)
    v = torch.randn(3, 50, generator=gen, dtype=F64)
    gamma, lam = 0.9, 0.8
    v_next = torch.cat([v[:, 1:], torch.zeros(3, 1, dtype=F64)], dim=1)
    delta = r + gamma * v_next - v
    adv, _ = gae_oracle(r, v, gamma, lam)
    np.testing.assert_allclose(adv, discounted_cumsum_oracle(delta, gamma * lam), **CLOSE)
    _, ret1 = gae_oracle(r, v, gamma, 1.0)
    np.testing.assert_allclose(ret1, discounted_returns_oracle(r, gamma), **CLOSE)
    np.testing.assert_allclose(
        discounted_returns_oracle(r, gamma), discounted_cumsum_oracle(r, gamma), **CLOSE
    )


def test_per_row_gamma_and_lam():
    r = torch.ones(2, 3, dtype=F64)
    v = torch.zeros(2, 3, dtype=F64)
    adv, _ = gae_oracle(r, v, t64([0.5, 1.0]), t64([1.0, 0.0]))
    # row 0: lam = 1 -> returns with gamma .5; row 1: lam = 0 -> A = r + gamma V' - V = 1
    assert adv.tolist() == [[1.75, 1.5, 1.0], [1.0, 1.0, 1.0]]


def test_empty_inputs():
    assert discounted_cumsum_oracle(torch.zeros(3, 0), 0.5).shape == (3, 0)
    assert discounted_cumsum_oracle(torch.zeros(0, 4), 0.5).shape == (0, 4)
    adv, ret = gae_oracle(torch.zeros(2, 0), torch.zeros(2, 0), 1.0, 0.9)
    assert adv.shape == ret.shape == (2, 0)
    assert discounted_returns_oracle(torch.zeros(0, 5), 1.0).shape == (0, 5)
