"""rlops.compat.slime against our own restatement of slime's documented formulas.

The restatements below are written from the formulas in slime's docstrings and comments (serial
loops over tokens, float64), not from its code. Deliberate differences are tested as
differences: the restatement and the adapter must disagree where slime is wrong.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlops.compat import slime

GEN_SEED = 20240607


def _gen(extra: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(GEN_SEED + extra)


# --------------------------------------------------------------------------- restatements
def ref_gae(r: torch.Tensor, v: torch.Tensor, gamma: float, lam: float):
    """slime's GAE on one padded batch: V past the end is 0, every token a step."""
    adv = torch.zeros_like(r)
    b, t_len = r.shape
    for i in range(b):
        last = 0.0
        for t in reversed(range(t_len)):
            nxt = v[i, t + 1] if t + 1 < t_len else 0.0
            last = r[i, t] + gamma * nxt - v[i, t] + gamma * lam * last
            adv[i, t] = last
    return adv, adv + v


def ref_returns(r: torch.Tensor, discount: float) -> torch.Tensor:
    out = torch.zeros_like(r)
    for i in range(r.shape[0]):
        g = 0.0
        for t in reversed(range(r.shape[1])):
            g = r[i, t] + discount * g
            out[i, t] = g
    return out


def ref_reinforce(reward: float, kl: torch.Tensor, mask: torch.Tensor, kl_coef, gamma):
    """slime: r_t = −kl_coef·kl_t·m_t, the outcome on the last mask-1 token, G over all tokens."""
    r = -kl_coef * kl * mask
    last = int(mask.nonzero()[-1])
    r[last] += reward
    return ref_returns(r[None], gamma)[0]


def compacted_returns(r_tok: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """The discounted return over the action tokens only, scattered back (0 elsewhere)."""
    idx = mask.nonzero().flatten()
    out = torch.zeros_like(r_tok)
    out[idx] = ref_returns(r_tok[idx][None], gamma)[0]
    return out


def ref_policy_loss(ppo_kl, adv, eps, eps_high, c=None):
    ratio = torch.exp(-ppo_kl)
    l1, l2 = -ratio * adv, -ratio.clamp(1 - eps, 1 + eps_high) * adv
    loss = torch.maximum(l1, l2)
    if c is not None:
        loss = torch.where(adv < 0, torch.minimum(-c * adv, loss), loss)
    return loss, (l2 > l1).float()


def ref_approx_kl(lp, base, kind, ratio=None):
    d = lp.float() - base.float()
    kl = {"k1": d, "k2": d**2 / 2}.get(kind)
    if kl is None:
        kl = torch.exp(-d) - 1 + d
    if ratio is not None:
        kl = ratio * kl
    return kl.clamp(-10, 10) if kind == "low_var_kl" else kl


def ref_slime_whiten(x: torch.Tensor, m: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """slime's whitening: E[x²] − E[x]² in float32, Bessel-corrected."""
    s, sq, n = (x * m).sum(), (x * x * m).sum(), m.sum()
    mean = s / n
    var = (sq / n - mean**2) * n / (n - 1)
    return (x - mean) * torch.rsqrt(var + eps)


def _ragged(lengths, gen, dtype=torch.float64):
    return [torch.randn(n, generator=gen, dtype=dtype) for n in lengths]


LENGTHS = [1, 7, 130, 3, 64, 65, 2]


# --------------------------------------------------------------------------- [B, T] estimators
@pytest.mark.parametrize("t_len", [1, 37, 300])
def test_gae_and_returns_match_the_serial_definition(t_len):
    gen = _gen(t_len)
    r = torch.randn(3, t_len, generator=gen, dtype=torch.float64)
    v = torch.randn(3, t_len, generator=gen, dtype=torch.float64)
    want = ref_gae(r, v, 0.99, 0.95)
    for fn in (slime.vanilla_gae, slime.chunked_gae):
        for got, exp in zip(fn(r, v, 0.99, 0.95), want):
            torch.testing.assert_close(got, exp, rtol=0, atol=1e-12)
    for disc in (0.0, 0.5, 0.99, 1.0):
        torch.testing.assert_close(
            slime.chunked_discounted_returns(r, disc, chunk_size=16), ref_returns(r, disc),
            rtol=0, atol=1e-12,
        )


def test_batch_gae_on_variable_length_lists():
    gen = _gen(1)
    values, rewards = _ragged(LENGTHS, gen), _ragged(LENGTHS, gen)
    totals = [n + 5 for n in LENGTHS]
    adv, ret = slime.get_advantages_and_returns_batch(totals, LENGTHS, values, rewards, 1.0, 0.95)
    for v, r, a, g in zip(values, rewards, adv, ret):
        want_a, want_g = ref_gae(r[None], v[None], 1.0, 0.95)
        torch.testing.assert_close(a, want_a[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(g, want_g[0], rtol=0, atol=1e-12)
    assert slime.get_advantages_and_returns_batch([], [], [], [], 1.0, 1.0) == ([], [])


# --------------------------------------------------------------------------- REINFORCE++
def _masks(lengths, gen, interior: bool):
    masks = []
    for n in lengths:
        m = torch.ones(n, dtype=torch.long)
        tail = int(torch.randint(0, n, (1,), generator=gen))  # trailing mask-0 tokens
        m[n - tail :] = 0
        if interior and n - tail > 6:
            m[2:5] = 0  # a tool-output span between actions
        masks.append(m)
    return masks


def test_reinforce_plus_plus_matches_slime_without_interior_spans():
    gen = _gen(2)
    kl = _ragged(LENGTHS, gen)
    masks = _masks(LENGTHS, gen, interior=False)
    rewards = torch.randn(len(LENGTHS), generator=gen, dtype=torch.float64)
    got = slime.get_reinforce_plus_plus_returns(rewards, kl, masks, LENGTHS, LENGTHS, 0.05, 0.9)
    for i, g in enumerate(got):
        want = ref_reinforce(rewards[i], kl[i], masks[i], 0.05, 0.9)
        torch.testing.assert_close(g, want * masks[i], rtol=0, atol=1e-12)


def test_reinforce_plus_plus_skips_tool_spans_where_slime_counts_them():
    """Deliberate difference: a mask-0 span is skipped, not a discount step."""
    gen = _gen(3)
    kl = _ragged(LENGTHS, gen)
    masks = _masks(LENGTHS, gen, interior=True)
    rewards = torch.randn(len(LENGTHS), generator=gen, dtype=torch.float64)
    for gamma in (1.0, 0.9):
        got = slime.get_reinforce_plus_plus_returns(rewards, kl, masks, LENGTHS, LENGTHS, 0.05,
                                                    gamma)
        for i, g in enumerate(got):
            m = masks[i]
            r_tok = -0.05 * kl[i] * m
            r_tok[int(m.nonzero()[-1])] += rewards[i]
            torch.testing.assert_close(g, compacted_returns(r_tok, m, gamma), rtol=0, atol=1e-12)
            slime_says = ref_reinforce(rewards[i], kl[i], m, 0.05, gamma)
            act = m.bool()
            if gamma == 1.0:  # γ = 1: the same values on every action token
                torch.testing.assert_close(g[act], slime_says[act], rtol=0, atol=1e-12)
        m, i = masks[2], 2  # 130 tokens with an interior span
        assert m[2:5].eq(0).all()
        slime_says = ref_reinforce(rewards[i], kl[i], m, 0.05, gamma)
        assert slime_says[2:5].abs().min() > 0  # slime carries returns through the span
        assert got[i][2:5].eq(0).all()
        if gamma < 1:  # and discounts the earlier actions three steps more
            assert not torch.allclose(got[i][:2], slime_says[:2])


def test_reinforce_baseline_and_grpo_broadcast():
    gen = _gen(4)
    kl = _ragged(LENGTHS, gen, torch.float32)
    rewards = torch.randn(len(LENGTHS), generator=gen)
    adv = slime.get_reinforce_plus_plus_baseline_advantages(rewards, kl, 0.1)
    ret = slime.get_grpo_returns(rewards, kl)
    for i, k in enumerate(kl):
        torch.testing.assert_close(adv[i], torch.ones_like(k) * rewards[i] - 0.1 * k)
        torch.testing.assert_close(ret[i], torch.ones_like(k) * rewards[i])
    old_style = slime.get_reinforce_plus_plus_baseline_advantages(
        rewards=rewards, kl=kl, loss_masks=[torch.ones_like(k) for k in kl], kl_coef=0.1)
    assert all(torch.equal(a, b) for a, b in zip(adv, old_style))


def test_add_outcome_rewards_without_cp_is_the_last_token():
    xs = [torch.zeros(3), torch.ones(1)]
    out = slime.add_outcome_rewards(xs, torch.tensor([2.0, 3.0]), [9, 2], [3, 1])
    assert torch.equal(out[0], torch.tensor([0.0, 0.0, 2.0]))
    assert torch.equal(out[1], torch.ones(1) * 4)
    assert torch.equal(xs[0], torch.zeros(3))  # inputs untouched


# --------------------------------------------------------------------------- KL and loss
@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_approx_kl(kind):
    gen = _gen(5)
    lp, base = torch.randn(50, generator=gen) * 3, torch.randn(50, generator=gen) * 3
    ratio = torch.rand(50, generator=gen) * 2
    for w in (None, ratio):
        got = slime.compute_approx_kl(lp.bfloat16(), base.bfloat16(), kind, importance_ratio=w)
        want = ref_approx_kl(lp.bfloat16(), base.bfloat16(), kind, w)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="kl_loss_type"):
        slime.compute_approx_kl(lp, base, "k4")


def test_approx_kl_k3_stays_finite_where_slime_overflows():
    lp, base = torch.tensor([-120.0]), torch.tensor([0.0])
    assert torch.isinf(ref_approx_kl(lp, base, "k3")).all()
    assert torch.isfinite(slime.compute_approx_kl(lp, base, "k3")).all()


@pytest.mark.parametrize("dual", [None, 3.0])
def test_policy_loss_per_token(dual):
    gen = _gen(6)
    ppo_kl = torch.randn(200, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(200, generator=gen, dtype=torch.float64)
    got = slime.compute_policy_loss(ppo_kl, adv, 0.2, 0.28, dual)
    for g, w in zip(got, ref_policy_loss(ppo_kl, adv, 0.2, 0.28, dual)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="dual-clip"):
        slime.compute_policy_loss(ppo_kl, adv, 0.2, 0.2, 1.0)


def test_policy_loss_is_finite_where_slime_overflows():
    ppo_kl, adv = torch.tensor([-200.0, -200.0]), torch.tensor([-1.0, 1.0])
    slime_says, _ = ref_policy_loss(ppo_kl, adv, 0.2, 0.2)
    assert not torch.isfinite(slime_says).all()
    loss, _ = slime.compute_policy_loss(ppo_kl, adv, 0.2, 0.2)
    assert torch.isfinite(loss).all()
    assert loss[1] == -1.2  # positive advantage: the clipped ratio 1.2 binds


# --------------------------------------------------------------------------- whitening
def test_whitening_matches_on_spread_values_and_is_finite_on_constants():
    gen = _gen(7)
    x = torch.randn(40, generator=gen)
    m = (torch.rand(40, generator=gen) > 0.3).long()
    got = slime.distributed_masked_whiten(x, m)
    torch.testing.assert_close(got * m, ref_slime_whiten(x, m) * m, rtol=1e-5, atol=1e-5)
    assert got[m == 0].eq(0).all()
    const, ones = torch.full((3,), 1.7), torch.ones(3)
    assert torch.isnan(ref_slime_whiten(const, ones)).all()  # E[x²] − E[x]² < 0 in float32
    got = slime.distributed_masked_whiten(const, ones)
    assert torch.isfinite(got).all() and got.abs().max() < 1e-2  # (x − mean)/sqrt(0 + eps)


# --------------------------------------------------------------------------- log-probs
def ref_logp_entropy(logits: torch.Tensor, tokens: torch.Tensor, keep=None):
    z = logits.double()
    masked = z if keep is None else z.masked_fill(~keep, -math.inf)
    logp = masked.log_softmax(-1).gather(-1, tokens[:, None])
    ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    return logp, ent


@pytest.mark.parametrize("chunk_size", [-1, 3])
def test_log_probs_and_entropy(chunk_size):
    gen = _gen(8)
    logits = (torch.randn(11, 17, generator=gen) * 3).requires_grad_()
    tokens = torch.randint(0, 17, (11,), generator=gen)
    keep = torch.rand(11, 17, generator=gen) < 0.4
    keep[torch.arange(11), tokens] = True  # slime keeps the sampled token
    for mask in (None, keep):
        logp, ent = slime.calculate_log_probs_and_entropy(
            logits, tokens, None, with_entropy=True, chunk_size=chunk_size,
            log_prob_keep_mask=mask)
        want_logp, want_ent = ref_logp_entropy(logits.detach(), tokens, mask)
        assert logp.shape == (11, 1) and ent.shape == (11,) and logp.dtype == torch.float32
        torch.testing.assert_close(logp.double(), want_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.double(), want_ent, rtol=1e-5, atol=1e-5)
        w = torch.randn(11, generator=gen)
        g, = torch.autograd.grad((logp[:, 0] * w).sum() + (ent * w).sum(), logits)
        z = logits.detach().double().requires_grad_()
        lp_ref, ent_ref = ref_logp_entropy(z, tokens, mask)
        g_ref, = torch.autograd.grad((lp_ref[:, 0] * w).sum() + (ent_ref * w).sum(), z)
        torch.testing.assert_close(g.double(), g_ref, rtol=1e-5, atol=1e-5)
    logp, ent = slime.calculate_log_probs_and_entropy(logits, tokens, None)
    assert ent is None and logp.shape == (11, 1)
    logp, ent = slime.calculate_log_probs_and_entropy(torch.zeros(0, 17), tokens[:0], None,
                                                      with_entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,)


def test_cp_helpers_are_identities_without_a_group():
    x = torch.arange(4.0)
    assert slime.all_gather_with_cp(x, 9, 4) is x
    assert slime.slice_log_prob_with_cp(x, 9, 4) is x
    with pytest.raises(ValueError, match="entries"):
        slime.slice_log_prob_with_cp(x, 9, 3)


def test_bad_lists_are_rejected():
    with pytest.raises(TypeError, match="list of 1-D"):
        slime.get_grpo_returns(torch.ones(2), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="1-D"):
        slime.get_grpo_returns(torch.ones(1), [torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="loss_masks"):
        slime.get_reinforce_plus_plus_returns(torch.ones(1), [torch.zeros(3)],
                                              [torch.ones(2)], [3], [5], 0.1, 1.0)


def test_exports_are_pinned_and_documented():
    assert slime.__all__ == sorted(slime.__all__)
    assert slime.__all__ == [
        "add_outcome_rewards", "all_gather_with_cp", "calculate_log_probs_and_entropy",
        "chunked_discounted_returns", "chunked_gae", "compute_approx_kl", "compute_policy_loss",
        "distributed_masked_whiten", "get_advantages_and_returns_batch", "get_grpo_returns",
        "get_reinforce_plus_plus_baseline_advantages", "get_reinforce_plus_plus_returns",
        "slice_log_prob_with_cp", "vanilla_gae",
    ]
    for name in slime.__all__:
        doc = getattr(slime, name).__doc__
        assert doc and ">>>" in doc, name
