"""rlops.compat.slime against our own restatement of slime's documented formulas.

The restatements below are written from the formulas in slime's docstrings and comments (serial
loops over tokens, float64), not from its code. Deliberate differences are tested as
differences: the restatement and the adapter must disagree where slime is wrong.

Float32 results follow the rule of ``tests/tolerances.py``: their error against the float64
restatement is at most twice the error of the same restatement run in float32, plus a few ulps.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.tolerances import assert_within_reference

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


def ref_approx_kl(lp, base, kind, ratio=None, dtype=torch.float32):
    """slime's compute_approx_kl, computed in ``dtype`` (slime: float32)."""
    d = lp.to(dtype) - base.to(dtype)
    kl = {"k1": d, "k2": d**2 / 2}.get(kind)
    if kl is None:
        kl = torch.exp(-d) - 1 + d
    if ratio is not None:
        kl = ratio.to(dtype) * kl
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
            slime.chunked_discounted_returns(r, disc, chunk_size=16),
            ref_returns(r, disc),
            rtol=0,
            atol=1e-12,
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
        got = slime.get_reinforce_plus_plus_returns(
            rewards, kl, masks, LENGTHS, LENGTHS, 0.05, gamma
        )
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
    masks = [torch.ones_like(k) for k in kl]
    # slime's signature since July 2025: (rewards, kl, loss_masks, kl_coef), loss_masks unused
    adv = slime.get_reinforce_plus_plus_baseline_advantages(rewards, kl, masks, 0.1)
    ret = slime.get_grpo_returns(rewards, kl)
    for i, k in enumerate(kl):
        torch.testing.assert_close(adv[i], torch.ones_like(k) * rewards[i] - 0.1 * k)
        torch.testing.assert_close(ret[i], torch.ones_like(k) * rewards[i])
    by_name = slime.get_reinforce_plus_plus_baseline_advantages(
        rewards=rewards, kl=kl, loss_masks=masks, kl_coef=0.1
    )
    assert all(torch.equal(a, b) for a, b in zip(adv, by_name))


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
        exact = ref_approx_kl(lp.bfloat16(), base.bfloat16(), kind, w, torch.float64)
        ref32 = ref_approx_kl(lp.bfloat16(), base.bfloat16(), kind, w)
        assert got.dtype == torch.float32
        assert_within_reference(f"approx_kl {kind}", got, exact, ref32)
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
    exact = ref_slime_whiten(x.double(), m.double()) * m
    assert_within_reference("whiten", got * m, exact, ref_slime_whiten(x, m) * m)
    assert got[m == 0].eq(0).all()
    const, ones = torch.full((3,), 1.7), torch.ones(3)
    assert torch.isnan(ref_slime_whiten(const, ones)).all()  # E[x²] − E[x]² < 0 in float32
    got = slime.distributed_masked_whiten(const, ones)
    assert torch.isfinite(got).all() and got.abs().max() < 1e-2  # (x − mean)/sqrt(0 + eps)


# --------------------------------------------------------------------------- log-probs
def ref_logp_entropy(logits: torch.Tensor, tokens: torch.Tensor, keep=None, dtype=torch.float64):
    z = logits.to(dtype)
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
            logits, tokens, None, with_entropy=True, chunk_size=chunk_size, log_prob_keep_mask=mask
        )
        assert logp.shape == (11, 1) and ent.shape == (11,) and logp.dtype == torch.float32
        w = torch.randn(11, generator=gen)
        (g,) = torch.autograd.grad((logp[:, 0] * w).sum() + (ent * w).sum(), logits)
        exact, ref32 = ({}, {})
        for out, dtype in ((exact, torch.float64), (ref32, torch.float32)):
            z = logits.detach().to(dtype).requires_grad_()
            out["logp"], out["ent"] = ref_logp_entropy(z, tokens, mask, dtype)
            (out["grad"],) = torch.autograd.grad(
                (out["logp"][:, 0] * w).sum() + (out["ent"] * w).sum(), z
            )
        for name, got in (("logp", logp), ("ent", ent), ("grad", g)):
            assert_within_reference(
                f"{name} chunk_size={chunk_size}",
                got.detach(),
                exact[name].detach(),
                ref32[name].detach(),
            )
    logp, ent = slime.calculate_log_probs_and_entropy(logits, tokens, None)
    assert ent is None and logp.shape == (11, 1)
    logp, ent = slime.calculate_log_probs_and_entropy(
        torch.zeros(0, 17), tokens[:0], None, with_entropy=True
    )
    assert logp.shape == (0,) and ent.shape == (0,)


def _sets_with_targets(n: int, v: int, tokens: torch.Tensor, gen: torch.Generator):
    """Random kept sets of 1 to v // 2 ids per row, each holding its row's target (the sampled
    token is in its own top-p set)."""
    sets = []
    for t in range(n):
        k = int(torch.randint(1, v // 2, (1,), generator=gen))
        ids = torch.randperm(v, generator=gen)[:k]
        sets.append(torch.cat([ids[ids != tokens[t]], tokens[t : t + 1]]))
    return sets


def _dense(sets, v: int) -> torch.Tensor:
    keep = torch.zeros(len(sets), v, dtype=torch.bool)
    for row, ids in enumerate(sets):
        keep[row, ids] = True
    return keep


def _csr(sets) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.tensor([len(x) for x in sets])
    return torch.cat(sets).to(torch.int32), torch.cat(
        [torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]
    ).to(torch.int32)


def test_log_probs_with_a_row_mask_and_csr_sets_equal_the_dense_mask():
    """``mask=``: slime's values on its True rows, exact zeros (and zero gradient) elsewhere;
    the CSR sets and the dense ``log_prob_keep_mask`` give the same bits."""
    gen = _gen(9)
    n, v = 13, 19
    logits = (torch.randn(n, v, generator=gen) * 3).requires_grad_()
    tokens = torch.randint(0, v, (n,), generator=gen)
    sets = _sets_with_targets(n, v, tokens, gen)
    keep = _dense(sets, v)
    ids, offsets = _csr(sets)
    rows = torch.rand(n, generator=gen) < 0.6
    w = torch.randn(n, generator=gen)
    got = []
    for kw in ({"log_prob_keep_mask": keep},
               {"log_prob_keep_ids": ids, "log_prob_keep_offsets": offsets}):  # fmt: skip
        logp, ent = slime.calculate_log_probs_and_entropy(
            logits, tokens, None, with_entropy=True, chunk_size=4, mask=rows, **kw
        )
        (g,) = torch.autograd.grad((logp[:, 0] * w).sum() + (ent * w).sum(), logits)
        got.append((logp.detach(), ent.detach(), g))
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)
    logp, ent, g = got[0]
    exact, ref32 = {}, {}
    for out, dtype in ((exact, torch.float64), (ref32, torch.float32)):
        z = logits.detach().to(dtype).requires_grad_()
        lp, en = ref_logp_entropy(z, tokens, keep, dtype)
        out["logp"], out["ent"] = lp[rows], en[rows]
        (out["grad"],) = torch.autograd.grad(
            (lp[rows, 0] * w[rows]).sum() + (en[rows] * w[rows]).sum(), z
        )
        out["grad"] = out["grad"][rows]
    for name, val in (("logp", logp[rows]), ("ent", ent[rows]), ("grad", g[rows])):
        assert_within_reference(name, val, exact[name].detach(), ref32[name].detach())
    assert torch.equal(logp[~rows], torch.zeros_like(logp[~rows]))
    assert torch.equal(ent[~rows], torch.zeros_like(ent[~rows]))
    assert torch.equal(g[~rows], torch.zeros_like(g[~rows]))


def _packed(gen: torch.Generator, v: int):
    """Three samples packed as slime packs them (prompt then response, rows back to back, two
    padding rows at the end), their top-p sets (ids per response token, holding the token)
    as slime records them, and loss masks with a tool span."""
    totals, responses = [6, 4, 7], [3, 1, 5]
    tokens = [torch.randint(0, v, (t,), generator=gen) for t in totals]
    ids, offs, sets = [], [], []
    for tok, r in zip(tokens, responses):
        s = _sets_with_targets(r, v, tok[-r:], gen)
        sets.append(s)
        counts = torch.tensor([len(x) for x in s])
        ids.append(torch.cat(s).to(torch.int32))
        offs.append(
            torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
        )
    loss_masks = [torch.tensor([1, 0, 1]), torch.tensor([1]), torch.tensor([1, 1, 0, 0, 1])]
    return totals, responses, tokens, ids, offs, sets, loss_masks


def _slime_response_values(logits, totals, responses, tokens, sets, tau, dtype):
    """slime's ``get_log_probs_and_entropy`` written plainly, sample by sample, token by token:
    row ``end − r − 1 + j`` of the logits divided by the temperature predicts response token
    ``j``; the log-prob is over its top-p set, the entropy over the whole vocabulary."""
    z_all = logits[0].to(dtype) / tau
    out_lp, out_ent, end = [], [], 0
    for total, r, tok, s in zip(totals, responses, tokens, sets):
        end += total
        lp, en = [], []
        for j in range(r):
            z = z_all[end - r - 1 + j]
            kept = torch.full_like(z, -math.inf)
            kept[s[j]] = z[s[j]]
            y = tok[total - r + j]
            lp.append(kept[y] - torch.logsumexp(kept, 0))
            p = z.softmax(0)
            en.append(-(p * z.log_softmax(0)).sum())
        out_lp.append(torch.stack(lp))
        out_ent.append(torch.stack(en))
    return out_lp, out_ent


@pytest.mark.parametrize("with_loss_masks", [False, True])
def test_get_log_probs_and_entropy_matches_slime_on_the_response_rows(with_loss_masks):
    from argparse import Namespace

    gen = _gen(10)
    v, tau = 23, 0.7
    totals, responses, tokens, ids, offs, sets, loss_masks = _packed(gen, v)
    logits = (torch.randn(1, sum(totals) + 2, v, generator=gen) * 3).requires_grad_()
    args = Namespace(rollout_temperature=tau, log_probs_chunk_size=4, entropy_coef=0.1)
    _, res = slime.get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=tokens, total_lengths=totals,
        response_lengths=responses, with_entropy=True, top_p_token_ids=ids,
        top_p_token_offsets=offs, loss_masks=loss_masks if with_loss_masks else None,
    )  # fmt: skip
    weights = [torch.randn(r, generator=gen) for r in responses]
    loss = sum(((a + b) * w).sum() for a, b, w in zip(res["log_probs"], res["entropy"], weights))
    (g,) = torch.autograd.grad(loss, logits)
    exact, ref32 = {}, {}
    for out, dtype in ((exact, torch.float64), (ref32, torch.float32)):
        z = logits.detach().to(dtype).requires_grad_()
        lp, en = _slime_response_values(z, totals, responses, tokens, sets, tau, dtype)
        if with_loss_masks:  # the loss masks' 0 tokens: exact zeros
            lp = [x * m for x, m in zip(lp, loss_masks)]
            en = [x * m for x, m in zip(en, loss_masks)]
        ref_loss = sum(((a + b) * w.to(dtype)).sum() for a, b, w in zip(lp, en, weights))
        (out["grad"],) = torch.autograd.grad(ref_loss, z)
        out["logp"], out["ent"] = torch.cat(lp).detach(), torch.cat(en).detach()
    got = {"logp": torch.cat(res["log_probs"]).detach(), "ent": torch.cat(res["entropy"]).detach(),
           "grad": g}  # fmt: skip
    for name in got:
        assert_within_reference(name, got[name], exact[name], ref32[name])
    if with_loss_masks:
        off = torch.cat(loss_masks) == 0
        assert torch.equal(got["logp"][off], torch.zeros(int(off.sum())))
        assert torch.equal(got["ent"][off], torch.zeros(int(off.sum())))
    rows = torch.zeros(logits.shape[1], dtype=torch.bool)  # prompt and padding rows: no gradient
    end = 0
    for total, r in zip(totals, responses):
        end += total
        rows[end - r - 1 : end - 1] = True
    assert torch.equal(g[0, ~rows], torch.zeros_like(g[0, ~rows]))


def test_get_log_probs_and_entropy_dense_and_csr_forms_agree():
    """The same response rows through the dense ``log_prob_keep_mask`` slime builds
    (``[T, V]``, rows without a set all True) and through the CSR sets."""
    from argparse import Namespace

    gen = _gen(11)
    v = 23
    totals, responses, tokens, ids, offs, sets, _ = _packed(gen, v)
    n_rows = sum(totals)
    logits = torch.randn(1, n_rows, v, generator=gen) * 3
    args = Namespace(rollout_temperature=1.0, log_probs_chunk_size=-1, entropy_coef=0.0)
    _, res = slime.get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=tokens, total_lengths=totals,
        response_lengths=responses, with_entropy=True, top_p_token_ids=ids,
        top_p_token_offsets=offs,
    )  # fmt: skip
    keep = torch.ones(n_rows, v, dtype=torch.bool)
    targets = torch.zeros(n_rows, dtype=torch.int64)
    end, rows = 0, []
    for total, r, tok, s in zip(totals, responses, tokens, sets):
        end += total
        targets[end - total : end - 1] = tok[1:]
        for j in range(r):
            keep[end - r - 1 + j] = False
            keep[end - r - 1 + j, s[j]] = True
        rows.append(slice(end - r - 1, end - 1))
    logp, ent = slime.calculate_log_probs_and_entropy(
        logits[0], targets, None, with_entropy=True, log_prob_keep_mask=keep
    )
    for a, b, sl in zip(res["log_probs"], res["entropy"], rows):
        assert torch.equal(a, logp[sl, 0]) and torch.equal(b, ent[sl])


def test_get_log_probs_and_entropy_bad_input_names_slimes_arguments():
    from argparse import Namespace

    args = Namespace(rollout_temperature=1.0, log_probs_chunk_size=-1, entropy_coef=0.0)
    logits = torch.zeros(1, 5, 4)
    ok = {"args": args, "unconcat_tokens": [torch.tensor([0, 1, 2])], "total_lengths": [3],
          "response_lengths": [2]}  # fmt: skip
    cases = [
        ({"response_lengths": [2, 1]}, "one entry per sample"),
        ({"response_lengths": [3]}, "response_lengths"),
        ({"total_lengths": [9]}, "total_lengths"),
        ({"top_p_token_ids": [torch.tensor([1])]}, "top_p_token_offsets"),
        ({"top_p_token_ids": [torch.tensor([1])], "top_p_token_offsets": [torch.tensor([0, 1])]},
         "top_p_token_offsets"),
        ({"loss_masks": [torch.ones(3)]}, "loss_masks"),
        ({"args": Namespace(allgather_cp=True)}, "allgather_cp"),
    ]  # fmt: skip
    for kw, words in cases:
        with pytest.raises(ValueError, match=words):
            slime.get_log_probs_and_entropy(logits, **{**ok, **kw})
    with pytest.raises(ValueError, match="logits"):
        slime.get_log_probs_and_entropy(logits[0], **ok)


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
        slime.get_reinforce_plus_plus_returns(
            torch.ones(1), [torch.zeros(3)], [torch.ones(2)], [3], [5], 0.1, 1.0
        )


# --------------------------------------------------------------------------- value loss
def _value_batch():
    """Two samples packed as slime packs them without CP: sample 0 has 4 tokens, the last 2 of
    them the response; sample 1 has 3 tokens, the last one the response. The value of response
    token i sits at position ``total − response − 1 + i`` of its sample."""
    logits = torch.tensor([0.0, 1.0, 3.0, 9.0, 7.0, 0.2, 8.0]).reshape(1, 7, 1)
    batch = {
        "values": [torch.tensor([1.0, 1.0]), torch.tensor([1.0])],  # old values
        "returns": [torch.tensor([0.0, 0.0]), torch.tensor([1.0])],
        "unconcat_tokens": [torch.zeros(4, dtype=torch.long), torch.zeros(3, dtype=torch.long)],
        "total_lengths": [4, 3],
        "response_lengths": [2, 1],
    }
    return logits, batch


def test_value_loss_function_by_hand():
    """slime: loss = max((V_clip − R)², (V − R)²) with V_clip = V_old + clip(V − V_old, ±c), no
    factor 1/2; clipfrac = |V − V_old| > c, both reduced by the caller's sum_of_sample_mean."""
    from argparse import Namespace

    logits, batch = _value_batch()
    logits.requires_grad_()
    args = Namespace(value_clip=0.5, allgather_cp=False)
    seen = []

    def token_mean(x):
        seen.append(x.detach().clone())
        return x.mean()

    loss, metrics = slime.value_loss_function(args, batch, logits, token_mean)
    # V = [1, 3 | 0.2] (positions 1, 2 | 4 + 1). Token 0: V = V_old, (1 − 0)² = 1, not clipped.
    # Token 1: V − V_old = 2 > 0.5: V_clip = 1.5, max(1.5², 3²) = 9, clipped.
    # Token 2: V − V_old = −0.8: V_clip = 0.5, max((0.5 − 1)², (0.2 − 1)²) = 0.64, clipped
    # (slime counts it although the unclipped error is the larger; verl would not).
    torch.testing.assert_close(seen[0], torch.tensor([1.0, 9.0, 0.64]))
    torch.testing.assert_close(seen[1], torch.tensor([0.0, 1.0, 1.0]))
    torch.testing.assert_close(loss, torch.tensor((1.0 + 9.0 + 0.64) / 3))
    torch.testing.assert_close(metrics["value_loss"], loss.detach())
    torch.testing.assert_close(metrics["value_clipfrac"], torch.tensor(2 / 3))
    assert set(metrics) == {"value_loss", "value_clipfrac"}
    (g,) = torch.autograd.grad(loss, logits)
    # d/dV of the chosen term (V − R)² / 3 on the response positions, 0 elsewhere
    want = torch.zeros(7)
    want[1], want[2], want[5] = 2 * 1.0 / 3, 2 * 3.0 / 3, 2 * (0.2 - 1.0) / 3
    torch.testing.assert_close(g.flatten(), want)


def test_value_loss_function_bad_input_names_slimes_arguments():
    from argparse import Namespace

    logits, batch = _value_batch()
    with pytest.raises(ValueError, match="value_clip"):
        slime.value_loss_function(
            Namespace(value_clip=-0.5, allgather_cp=False), batch, logits, torch.mean
        )
    short = dict(batch, returns=[torch.zeros(2)])
    with pytest.raises(ValueError, match="returns"):
        slime.value_loss_function(
            Namespace(value_clip=0.5, allgather_cp=False), short, logits, torch.mean
        )
    with pytest.raises(ValueError, match="logits"):
        slime.value_loss_function(
            Namespace(value_clip=0.5, allgather_cp=False), batch, logits[:, :5], torch.mean
        )
    # a response filling its sequence: no position holds the value of response token 0
    # (slime reads logits[-1] for it)
    whole = dict(batch, total_lengths=[2, 3], values=[torch.ones(2), torch.ones(1)])
    with pytest.raises(ValueError, match=r"response_lengths\[0\] = total_lengths\[0\]"):
        slime.value_loss_function(
            Namespace(value_clip=0.5, allgather_cp=False), whole, logits, torch.mean
        )


# --------------------------------------------------------------------------- argument handling
def test_numpy_and_0d_tensor_scalars_are_accepted():
    """verl and slime configs hand over np.float32 and 0-dim tensors for the coefficients."""
    np = pytest.importorskip("numpy")
    gen = _gen(9)
    kl = _ragged([3, 2], gen, torch.float32)
    rewards = torch.tensor([1.0, -1.0])
    masks = [torch.ones(3), torch.ones(2)]
    want = slime.get_reinforce_plus_plus_baseline_advantages(rewards, kl, masks, 0.1)
    for coef in (np.float32(0.1), np.float64(0.1), torch.tensor(0.1)):
        got = slime.get_reinforce_plus_plus_baseline_advantages(rewards, kl, masks, coef)
        assert all(isinstance(g, torch.Tensor) for g in got)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        got = slime.get_reinforce_plus_plus_returns(
            rewards, kl, masks, [3, 2], [5, 5], coef, np.float32(0.9)
        )
        torch.testing.assert_close(
            got[0],
            slime.get_reinforce_plus_plus_returns(rewards, kl, masks, [3, 2], [5, 5], 0.1, 0.9)[0],
        )
    r, v = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
    want = slime.vanilla_gae(r, v, 0.9, 0.95)
    for gamma, lam in (
        (np.float32(0.9), np.float32(0.95)),
        (torch.tensor(0.9), torch.tensor(0.95)),
    ):
        for got, w in zip(slime.chunked_gae(r, v, gamma, lam), want):
            torch.testing.assert_close(got, w)
    ppo_kl, adv = torch.randn(7, generator=gen) * 0.3, torch.randn(7, generator=gen)
    want = slime.compute_policy_loss(ppo_kl, adv, 0.2, 0.28, 3.0)
    for eps in (np.float32, torch.tensor):
        got = slime.compute_policy_loss(ppo_kl, adv, eps(0.2), eps(0.28), eps(3.0))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


def test_eps_clip_of_one_or_more_means_no_lower_clip_as_in_slime():
    """slime clamps the ratio to [1 − eps_clip, ...]: with eps_clip ≥ 1 the floor is ≤ 0 and
    never binds (canonical CISPO settings use eps_clip ≥ 1)."""
    ppo_kl = torch.tensor([3.0, 3.0])  # ratio e^−3 ≈ 0.05
    adv = torch.tensor([-1.0, 1.0])
    for eps in (1.0, 5.0):
        loss, frac = slime.compute_policy_loss(ppo_kl, adv, eps, 0.2)
        ratio = math.exp(-3.0)
        torch.testing.assert_close(loss, torch.tensor([ratio, -ratio]))
        assert frac.eq(0).all()


BAD_SLIME_CALLS = [
    # (call, error type, the argument the message must name)
    (
        lambda: slime.compute_policy_loss(torch.zeros(3), torch.ones(3), -0.1, 0.2),
        ValueError,
        "eps_clip",
    ),
    (
        lambda: slime.compute_policy_loss(torch.zeros(3), torch.ones(3), 0.2, -0.2),
        ValueError,
        "eps_clip_high",
    ),
    (
        lambda: slime.compute_policy_loss(torch.zeros(3), torch.ones(3), 0.0, 0.2),
        ValueError,
        "eps_clip",
    ),
    (
        lambda: slime.compute_policy_loss(torch.zeros(3), torch.ones(4), 0.2, 0.2),
        ValueError,
        "advantages",
    ),
    (
        lambda: slime.compute_policy_loss(torch.zeros(3), torch.ones(3), 0.2, 0.2, 1.0),
        ValueError,
        "eps_clip_c",
    ),
    (
        lambda: slime.get_advantages_and_returns_batch(
            [9], [3], [torch.ones(3)], [torch.ones(2)], 1.0, 1.0
        ),
        ValueError,
        r"rewards_list\[0\]",
    ),
    (
        lambda: slime.get_advantages_and_returns_batch(
            [9], [3], [torch.ones(1)], [torch.ones(3)], 1.0, 1.0
        ),
        ValueError,
        r"values_list\[0\]",
    ),
    (
        lambda: slime.get_advantages_and_returns_batch(
            [2], [3], [torch.ones(3)], [torch.ones(3)], 1.0, 1.0
        ),
        ValueError,
        "total_lengths",
    ),
    (
        lambda: slime.get_advantages_and_returns_batch(
            [9, 9], [3], [torch.ones(3)], [torch.ones(3)], 1.0, 1.0
        ),
        ValueError,
        "total_lengths",
    ),
    (
        lambda: slime.get_advantages_and_returns_batch(
            [9], [3], [torch.ones(3)], [torch.ones(3)], 1.0, 1.5
        ),
        ValueError,
        "lambd",
    ),
    (
        lambda: slime.get_reinforce_plus_plus_returns(
            torch.ones(2), [torch.zeros(3)], [torch.ones(3)], [3], [5], 0.1, 1.0
        ),
        ValueError,
        "rewards",
    ),
    (
        lambda: slime.get_reinforce_plus_plus_returns(
            torch.ones(1), [torch.zeros(3)], [torch.ones(3)], [3], [2], 0.1, 1.0
        ),
        ValueError,
        "total_lengths",
    ),
    (
        lambda: slime.get_reinforce_plus_plus_returns(
            torch.ones(1), [torch.zeros(3)], [torch.ones(3)], [3], [5], "0.1", 1.0
        ),
        TypeError,
        "kl_coef",
    ),
    (
        lambda: slime.get_reinforce_plus_plus_baseline_advantages(
            torch.ones(3), [torch.zeros(2)] * 2, [torch.ones(2)] * 2, 0.1
        ),
        ValueError,
        "rewards",
    ),
    (lambda: slime.get_grpo_returns(torch.ones(3), [torch.zeros(2)] * 2), ValueError, "rewards"),
    (
        lambda: slime.add_outcome_rewards([torch.zeros(3)], [1.0, 2.0], [5], [3]),
        ValueError,
        "rewards",
    ),
    (lambda: slime.all_gather_with_cp(torch.zeros(4), 3, 4), ValueError, "response_length"),
    (lambda: slime.slice_log_prob_with_cp(torch.zeros(4), 3, 4), ValueError, "response_length"),
    (
        lambda: slime.slice_log_prob_with_cp(torch.zeros(4), 9, 4, qkv_format="sbhd"),
        ValueError,
        "qkv_format",
    ),
    (lambda: slime.vanilla_gae([[0.0, 1.0]], torch.zeros(1, 2), 1.0, 1.0), TypeError, "rewards"),
    (
        lambda: slime.vanilla_gae(torch.zeros(1, 2), torch.zeros(1, 3), 1.0, 1.0),
        ValueError,
        "values",
    ),
    (lambda: slime.chunked_discounted_returns(torch.zeros(1, 2), -0.5), ValueError, "discount"),
]


@pytest.mark.parametrize("i", range(len(BAD_SLIME_CALLS)))
def test_bad_input_names_slimes_argument(i):
    call, err, name = BAD_SLIME_CALLS[i]
    with pytest.raises(err, match=name):
        call()


def test_exports_are_pinned_and_documented():
    assert slime.__all__ == sorted(slime.__all__)
    assert slime.__all__ == [
        "add_outcome_rewards",
        "all_gather_with_cp",
        "calculate_log_probs_and_entropy",
        "chunked_discounted_returns",
        "chunked_gae",
        "compute_approx_kl",
        "compute_cispo_loss",
        "compute_opsm_mask",
        "compute_policy_loss",
        "distributed_masked_whiten",
        "get_advantages_and_returns_batch",
        "get_grpo_returns",
        "get_log_probs_and_entropy",
        "get_reinforce_plus_plus_baseline_advantages",
        "get_reinforce_plus_plus_returns",
        "icepop_function",
        "slice_log_prob_with_cp",
        "value_loss_function",
        "vanilla_gae",
        "vanilla_tis_function",
        "zigzag_response_mask",
        "zigzag_shard_response",
        "zigzag_unshard_response",
    ]
    for name in slime.__all__:
        doc = getattr(slime, name).__doc__
        assert doc and ">>>" in doc, name


@pytest.mark.parametrize(
    "name", ["zigzag_response_mask", "zigzag_shard_response", "zigzag_unshard_response"]
)
def test_the_response_layout_helpers_are_public_in_compat_slime(name):
    """The CHANGELOG's "moved to rlops.compat.slime": importable there; the old path under
    rlops.distributed says where they went rather than a bare AttributeError."""
    import rlops.compat.slime
    import rlops.distributed

    assert callable(getattr(rlops.compat.slime, name))
    with pytest.raises(AttributeError, match=f"rlops.compat.slime.{name}"):
        getattr(rlops.distributed, name)
