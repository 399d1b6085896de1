"""rlops.compat.verl against our own restatement of verl's documented formulas.

The restatements are plain loops written from the formulas in verl's docstrings and comments
(float64), not copies of its code. Deliberate differences are tested as differences.
Float32 results follow the rule of ``tests/tolerances.py``: their error against the float64
restatement is at most twice the error of the same restatement run in float32, plus a few ulps.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tests.tolerances import assert_within_reference

from rlops.compat import verl

B, T = 6, 23


def _gen(extra: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(9000 + extra)


def _prefix_mask(gen: torch.Generator) -> torch.Tensor:
    """Right-padded response masks (``[EOS]`` masks); the last row is full."""
    n = torch.randint(2, T + 1, (B,), generator=gen)
    n[-1] = T
    return (torch.arange(T) < n[:, None]).long()


def _with_tool_spans(mask: torch.Tensor) -> torch.Tensor:
    m = mask.clone()
    m[:, 3:6] = 0  # tool output between actions, in every row
    m[:, 0] = 1
    m[:, 7] = 1
    return m


# --------------------------------------------------------------------------- restatements
def ref_whiten(x: torch.Tensor, m: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """verl: mean and two-pass unbiased variance over mask-1 entries; raises on < 2 entries."""
    m = m.double()
    n = m.sum()
    mean = (x * m).sum() / n
    if n < 2:
        raise ValueError("at least two selected entries are needed")
    var = (((x - mean) ** 2) * m).sum() / n * n / (n - 1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return out + mean if not shift_mean else out


def ref_gae(r, v, m, gamma, lam):
    """verl's multi-turn GAE: mask-0 tokens pass the next value and advantage through."""
    adv = torch.zeros_like(r)
    for i in range(r.shape[0]):
        nxt, last = 0.0, 0.0
        for t in reversed(range(r.shape[1])):
            if m[i, t]:
                last = r[i, t] + gamma * nxt - v[i, t] + gamma * lam * last
                nxt = v[i, t]
            adv[i, t] = last
    return ref_whiten(adv, m), adv + v


def ref_group_scores(scores, index, how: str, eps: float = 1e-6, norm: bool = True):
    groups = defaultdict(list)
    for i, g in enumerate(index):
        groups[g].append(float(scores[i]))
    out = torch.zeros_like(scores)
    for i, g in enumerate(index):
        s = torch.tensor(groups[g], dtype=torch.float64)
        n = len(s)
        if how == "grpo":
            mean, std = (0.0, 1.0) if n == 1 else (s.mean(), s.std())
            out[i] = (scores[i] - mean) / (std + eps) if norm else scores[i] - mean
        elif how == "rloo":
            out[i] = scores[i] if n == 1 else (scores[i] * n - s.sum()) / (n - 1)
        else:  # group mean only
            out[i] = scores[i] - (0.0 if n == 1 else s.mean())
    return out


def ref_reinforce(r, m, gamma):
    """verl since PR #7300 (2026-08): on a mask-1 token ``G = r + γ·G``; a mask-0 token gets
    return 0 and carries the running return unchanged (its own reward is not added)."""
    ret = torch.zeros_like(r)
    for i in range(r.shape[0]):
        g = 0.0
        for t in reversed(range(r.shape[1])):
            if m[i, t]:
                g = r[i, t] + gamma * g
                ret[i, t] = g
    return ref_whiten(ret, m) * m, ret


def ref_reinforce_reset(r, m, gamma):
    """verl before PR #7300: the running return resets after every mask-0 token."""
    ret = torch.zeros_like(r)
    for i in range(r.shape[0]):
        g = 0.0
        for t in reversed(range(r.shape[1])):
            g = r[i, t] + gamma * g
            ret[i, t] = g
            g = g * m[i, t]
    return ref_whiten(ret, m) * m, ret


def ref_agg(loss, m, mode, dp_size=1, n_tok=None, n_seq=None, scale=None):
    """verl's ``agg_loss`` modes as its docstring and PR #5417 define them, row by row.

    The local sum over the micro-batch is divided by the *global* count (``batch_num_tokens``
    tokens, ``global_batch_size`` sequences; this micro-batch's own count when not given) and
    multiplied by ``dp_size``. Rows without a mask-1 token do not count as sequences.
    """
    rows = []  # (token sum, token count) of each row that has a mask-1 token
    for i in range(loss.shape[0]):
        count = sum(int(m[i, t]) for t in range(loss.shape[1]))
        total = sum(float(loss[i, t]) for t in range(loss.shape[1]) if m[i, t])
        if count:
            rows.append((total, count))
    if mode == "token-sum":
        return torch.tensor(sum(s for s, _ in rows) * dp_size, dtype=torch.float64)
    if mode == "token-mean":
        n = sum(c for _, c in rows) if n_tok is None else n_tok
        return torch.tensor(sum(s for s, _ in rows) / n * dp_size, dtype=torch.float64)
    n = len(rows) if n_seq is None else n_seq
    if mode == "seq-mean-token-mean":
        out = sum(s / c for s, c in rows) / n * dp_size
    else:  # seq-mean-token-sum, and -norm: the same value divided by L (default T)
        out = sum(s for s, _ in rows) / n * dp_size
        if mode == "seq-mean-token-sum-norm":
            out /= loss.shape[1] if scale is None else scale
    return torch.tensor(out, dtype=torch.float64)


def ref_policy_loss(old, new, adv, m, low, high, c, mode, weights=None, agg_kw=()):
    nkl = (new - old).clamp(-20, 20)
    ratio = nkl.exp()
    l1, l2 = -adv * ratio, -adv * ratio.clamp(1 - low, 1 + high)
    c1 = torch.maximum(l1, l2)
    l3 = -adv * c
    losses = torch.where(adv < 0, torch.minimum(l3, c1), c1)
    if weights is not None:
        losses = losses * weights
    md = m.double()

    def mean(x):
        return (x * md).sum() / md.sum()

    return (
        ref_agg(losses, m, mode, *agg_kw),
        mean((l2 > l1).double()),
        mean(-nkl),
        mean(((c1 > l3) & (adv < 0)).double()),
    )


def ref_kl(lp, ref, kind):
    d = lp - ref
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("k2", "mse"):
        return 0.5 * d**2
    kl = (ref - lp).clamp(-20, 20)
    return (kl.exp() - kl - 1).clamp(-10, 10)


# --------------------------------------------------------------------------- estimators
def test_gae_matches_on_action_tokens_and_is_zero_elsewhere():
    gen = _gen(1)
    r = torch.randn(B, T, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, generator=gen, dtype=torch.float64)
    m = _with_tool_spans(_prefix_mask(gen))
    adv, ret = verl.compute_gae_advantage_return(r, v, m, gamma=0.99, lam=0.95)
    want_adv, want_ret = ref_gae(r, v, m, 0.99, 0.95)
    act = m.bool()
    torch.testing.assert_close(adv[act], want_adv[act], rtol=0, atol=1e-10)
    torch.testing.assert_close(ret[act], want_ret[act], rtol=0, atol=1e-10)
    assert adv[~act].eq(0).all() and ret[~act].eq(0).all()
    assert want_adv[~act].abs().max() > 0  # verl leaves values on observation tokens
    g = torch.tensor(0.9, dtype=torch.float64)  # verl types gamma and lam as tensors
    torch.testing.assert_close(
        verl.compute_gae_advantage_return(r, v, m, g, g)[0][act],
        ref_gae(r, v, m, 0.9, 0.9)[0][act],
        rtol=0,
        atol=1e-10,
    )


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_rloo_and_baseline_with_string_uids(norm):
    gen = _gen(2)
    r = torch.randn(B, T, generator=gen, dtype=torch.float64)
    m = _prefix_mask(gen)
    index = np.array(["b", "a", "b", "c", "a", "b"], dtype=object)  # "c" is a group of one
    scores = r.sum(-1)
    adv, ret = verl.compute_grpo_outcome_advantage(r, m, index, norm_adv_by_std_in_grpo=norm)
    assert adv is ret
    torch.testing.assert_close(adv, ref_group_scores(scores, index, "grpo", norm=norm)[:, None] * m)
    adv, _ = verl.compute_rloo_outcome_advantage(r, m, index)
    torch.testing.assert_close(adv, ref_group_scores(scores, index, "rloo")[:, None] * m)
    adv, _ = verl.compute_reinforce_plus_plus_baseline_outcome_advantage(r, m, list(index))
    centred = ref_group_scores(scores, index, "mean")[:, None].expand(B, T) * m
    torch.testing.assert_close(adv, ref_whiten(centred, m) * m)
    ids = torch.tensor([7, 3, 7, 9, 3, 7])  # integer ids work the same
    torch.testing.assert_close(
        verl.compute_rloo_outcome_advantage(r, m, ids)[0],
        ref_group_scores(scores, index, "rloo")[:, None] * m,
    )


def test_reinforce_plus_plus_matches_without_tool_spans():
    gen = _gen(3)
    m = _prefix_mask(gen)
    r = torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.1 * m
    cfg = SimpleNamespace(gamma=0.9)
    for got, want, old in zip(
        verl.compute_reinforce_plus_plus_outcome_advantage(r, m, cfg),
        ref_reinforce(r, m, 0.9),
        ref_reinforce_reset(r, m, 0.9),
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        torch.testing.assert_close(got, old, rtol=0, atol=1e-10)  # no span: all versions agree
    with pytest.raises(ValueError, match="gamma"):
        verl.compute_reinforce_plus_plus_outcome_advantage(r, m, {})


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
def test_reinforce_plus_plus_matches_across_tool_spans(gamma):
    """verl since PR #7300 carries the return across mask-0 spans, rewards on them included."""
    gen = _gen(30)
    m = _with_tool_spans(_prefix_mask(gen))
    r = torch.randn(B, T, generator=gen, dtype=torch.float64)  # rewards on mask-0 tokens too
    for got, want in zip(
        verl.compute_reinforce_plus_plus_outcome_advantage(r, m, {"gamma": gamma}),
        ref_reinforce(r, m, gamma),
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_reinforce_plus_plus_keeps_the_outcome_across_tool_spans():
    """As verl since PR #7300; verl's earlier reset dropped the outcome before a tool span."""
    gen = _gen(4)
    m = _with_tool_spans(_prefix_mask(gen))
    last = T - 1 - m.flip(-1).argmax(-1)
    r = torch.zeros(B, T, dtype=torch.float64)
    r[torch.arange(B), last] = 1.0  # the outcome on the last action token
    _, ret = verl.compute_reinforce_plus_plus_outcome_advantage(r, m, {"gamma": 1.0})
    _, old_ret = ref_reinforce_reset(r, m, 1.0)
    act = m.bool()
    assert ret[act].eq(1.0).all()  # every action sees the outcome (γ = 1)
    assert old_ret[:, :3].eq(0).all()  # verl before #7300: actions before the span see nothing
    for i in range(B):
        idx = m[i].nonzero().flatten()
        want = torch.zeros(T, dtype=torch.float64)
        g = 0.0
        for t in reversed(idx.tolist()):  # γ = 0.5 on the compacted sequence
            g = r[i, t] + 0.5 * g
            want[t] = g
        torch.testing.assert_close(
            verl.compute_reinforce_plus_plus_outcome_advantage(r, m, {"gamma": 0.5})[1][i], want
        )


def test_remax():
    gen = _gen(5)
    m = _with_tool_spans(_prefix_mask(gen))
    r = torch.randn(B, T, generator=gen, dtype=torch.float64)
    base = torch.randn(B, generator=gen, dtype=torch.float64)
    adv, ret = verl.compute_remax_outcome_advantage(r, base, m)
    want_ret = (r * m).flip(-1).cumsum(-1).flip(-1)
    act = m.bool()
    torch.testing.assert_close(ret[act], want_ret[act])
    torch.testing.assert_close(adv[act], (want_ret - base[:, None] * m)[act])
    assert adv[~act].eq(0).all()


# --------------------------------------------------------------------------- KL and losses
@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_penalty(kind):
    gen = _gen(6)
    lp = torch.randn(B, T, generator=gen, dtype=torch.float64) * 4
    ref = torch.randn(B, T, generator=gen, dtype=torch.float64) * 4
    lp[0, :4] = torch.tensor([-60.0, 60.0, -25.0, 25.0])  # beyond verl's ±20 clamp
    torch.testing.assert_close(verl.kl_penalty(lp, ref, kind), ref_kl(lp, ref, kind))
    plus = verl.kl_penalty(lp.requires_grad_(), ref, kind + "+")
    (g,) = torch.autograd.grad(plus.sum(), lp)
    torch.testing.assert_close(plus.detach(), ref_kl(lp.detach(), ref, kind))
    torch.testing.assert_close(g, (lp - ref).detach())  # straight-through: k2's gradient
    with pytest.raises(NotImplementedError):
        verl.kl_penalty(lp, ref, "full")


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl", "k3"])
def test_kl_penalty_gradient_is_verls(kind):
    """verl's own form, gradient included: no importance correction, and ``low_var_kl``'s
    ``clamp(·, −10, 10)`` has gradient 0 where it saturates (either side of the reference)."""
    gen = _gen(32)
    ref = torch.randn(B, T, generator=gen, dtype=torch.float64) - 2
    lp = ref + torch.randn(B, T, generator=gen, dtype=torch.float64) * 5
    lp[0, :4] = ref[0, :4] + torch.tensor([-3.0, 12.0, -25.0, 25.0])  # saturated (k3 > 10)
    lp1, lp2 = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(verl.kl_penalty(lp1, ref, kind).sum(), lp1)
    (want,) = torch.autograd.grad(ref_kl(lp2, ref, kind).sum(), lp2)
    torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)
    if kind in ("low_var_kl", "k3"):
        assert g[0, :4].eq(0).all()


MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def test_agg_loss_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    want = {
        "token-mean": 10 / 4,  # (1 + 2 + 3 + 4) / 4 tokens
        "token-sum": 10.0,
        "seq-mean-token-sum": (6 + 4) / 2,
        "seq-mean-token-mean": (6 / 3 + 4 / 1) / 2,
        "seq-mean-token-sum-norm": (6 + 4) / 2 / 3,  # divided by T = 3
    }
    for mode, value in want.items():
        torch.testing.assert_close(verl.agg_loss(loss, m, mode), torch.tensor(value))
    # global normalisers, times dp_size: 10 / 8 tokens · 2, 10 / 4 sequences · 2, ... / 5
    kw = dict(dp_size=2, batch_num_tokens=8, global_batch_size=4)
    torch.testing.assert_close(verl.agg_loss(loss, m, "token-mean", **kw), torch.tensor(2.5))
    torch.testing.assert_close(verl.agg_loss(loss, m, "token-sum", **kw), torch.tensor(20.0))
    torch.testing.assert_close(
        verl.agg_loss(loss, m, "seq-mean-token-sum", **kw), torch.tensor(5.0)
    )
    torch.testing.assert_close(
        verl.agg_loss(loss, m, "seq-mean-token-mean", **kw), torch.tensor(3.0)
    )
    torch.testing.assert_close(
        verl.agg_loss(loss, m, "seq-mean-token-sum-norm", loss_scale_factor=5, **kw),
        torch.tensor(1.0),
    )


@pytest.mark.parametrize("mode", [*MODES, "token-sum"])
def test_agg_loss(mode):
    gen = _gen(7)
    loss = torch.randn(B, T, generator=gen, dtype=torch.float64)
    m = _prefix_mask(gen)
    m[1] = 0  # a row with no token
    torch.testing.assert_close(verl.agg_loss(loss, m, mode), ref_agg(loss, m, mode))
    kw = dict(dp_size=4, batch_num_tokens=200, global_batch_size=20, loss_scale_factor=64)
    torch.testing.assert_close(
        verl.agg_loss(loss, m, mode, **kw), ref_agg(loss, m, mode, 4, 200, 20, 64)
    )
    for n in (np.int64(200), torch.tensor(200)):  # counts arrive as numpy or 0-dim tensors
        torch.testing.assert_close(
            verl.agg_loss(
                loss,
                m,
                mode,
                dp_size=np.int64(4),
                batch_num_tokens=n,
                global_batch_size=torch.tensor(20),
                loss_scale_factor=np.float32(64),
            ),
            ref_agg(loss, m, mode, 4, 200, 20, 64),
        )
    if mode != "token-sum":  # token-sum needs no global count
        with pytest.raises(ValueError, match="required when dp_size"):
            verl.agg_loss(loss, m, mode, dp_size=2)
    assert verl.agg_loss(loss, torch.zeros_like(m), mode) == 0  # verl: NaN or 0
    empty = dict(dp_size=2, batch_num_tokens=0, global_batch_size=0)  # verl divides by 0
    assert verl.agg_loss(loss, torch.zeros_like(m), mode, **empty) == 0
    for bad in (0, -1):
        with pytest.raises(ValueError, match="dp_size"):
            verl.agg_loss(loss, m, mode, dp_size=bad, batch_num_tokens=200, global_batch_size=20)
    with pytest.raises(TypeError, match="dp_size"):
        verl.agg_loss(loss, m, mode, dp_size=2.5, batch_num_tokens=200, global_batch_size=20)


@pytest.mark.parametrize("mode", MODES)
def test_policy_loss(mode):
    gen = _gen(8)
    old = torch.randn(B, T, generator=gen, dtype=torch.float64)
    new = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.4
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    m = _with_tool_spans(_prefix_mask(gen))
    got = verl.compute_policy_loss(
        old, new, adv, m, cliprange=0.2, cliprange_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode
    )
    want = ref_policy_loss(old, new, adv, m, 0.2, 0.28, 3.0, mode)
    for g, w in zip(got, want):  # verl's seq-mean-token-mean adds 1e-8 to each count
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-12)
    with pytest.raises(ValueError, match="cliprange"):
        verl.compute_policy_loss(old, new, adv, m)


@pytest.mark.parametrize("mode", MODES)
def test_registered_vanilla_policy_loss(mode):
    """verl's registered "vanilla" loss: ``(pg_loss, metrics)`` with Python floats under
    ``actor/...``, clip ranges from the actor config, ``rollout_is_weights`` multiplying the
    per-token loss and ``config.global_batch_info`` passed on to ``agg_loss``."""
    gen = _gen(12)
    old = torch.randn(B, T, generator=gen, dtype=torch.float64)
    new = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.4
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    w = torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    m = _with_tool_spans(_prefix_mask(gen))
    cfg = SimpleNamespace(
        clip_ratio=0.2,
        clip_ratio_low=None,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        global_batch_info={},
    )
    loss, metrics = verl.compute_policy_loss_vanilla(old, new, adv, m, mode, cfg)
    want = ref_policy_loss(old, new, adv, m, 0.2, 0.28, 3.0, mode)
    torch.testing.assert_close(loss, want[0], rtol=1e-8, atol=1e-12)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    for key, value in zip(
        ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"), want[1:]
    ):
        assert isinstance(metrics[key], float)
        assert metrics[key] == pytest.approx(float(value), rel=1e-12, abs=1e-12)
    # rollout_is_weights multiplies the per-token loss; the metrics do not change
    loss_w, metrics_w = verl.compute_policy_loss_vanilla(
        old, new, adv, m, mode, cfg, rollout_is_weights=w
    )
    torch.testing.assert_close(
        loss_w,
        ref_policy_loss(old, new, adv, m, 0.2, 0.28, 3.0, mode, weights=w)[0],
        rtol=1e-8,
        atol=1e-12,
    )
    assert metrics_w == metrics
    cfg.global_batch_info = {
        "dp_size": 2,
        "batch_num_tokens": 300,
        "global_batch_size": 12,
        "loss_scale_factor": 40,
    }
    loss_g, _ = verl.compute_policy_loss_vanilla(old, new, adv, m, mode, cfg)
    torch.testing.assert_close(
        loss_g,
        ref_policy_loss(old, new, adv, m, 0.2, 0.28, 3.0, mode, agg_kw=(2, 300, 12, 40))[0],
        rtol=1e-8,
        atol=1e-12,
    )
    with pytest.raises(ValueError, match="clip_ratio_c"):
        verl.compute_policy_loss_vanilla(
            old, new, adv, m, mode, SimpleNamespace(clip_ratio=0.2, clip_ratio_c=1.0)
        )


def test_policy_loss_clamps_only_the_exp_side():
    """Deliberate difference: verl clamps the log-ratio to [−20, 20], rlops only above."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[-30.0, 30.0]], dtype=torch.float64)
    adv, m = torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2)
    loss, _, ppo_kl, _ = verl.compute_policy_loss(old, new, adv, m, cliprange=0.2)
    want = ref_policy_loss(old, new, adv, m, 0.2, 0.2, 3.0, "token-mean")
    torch.testing.assert_close(loss, want[0])  # the ratios differ by ~1e-9 only
    assert ppo_kl == 0.0 and want[2] == 0.0  # ±30 vs ±20: both cancel here
    one = [x[:, :1] for x in (old, new, adv, m)]
    assert verl.compute_policy_loss(*one, cliprange=0.2)[2] == 30.0
    assert ref_policy_loss(*one, 0.2, 0.2, 3.0, "token-mean")[2] == 20.0  # verl reports 20


@pytest.mark.parametrize("mode", MODES)
def test_value_loss(mode):
    gen = _gen(9)
    vpreds, values, returns = (
        torch.randn(B, T, generator=gen, dtype=torch.float64) for _ in range(3)
    )
    m = _prefix_mask(gen)
    loss, frac = verl.compute_value_loss(vpreds, returns, values, m, 0.5, mode)
    clipped = torch.maximum(torch.minimum(vpreds, values + 0.5), values - 0.5)
    l1, l2 = (vpreds - returns) ** 2, (clipped - returns) ** 2
    torch.testing.assert_close(loss, 0.5 * ref_agg(torch.maximum(l1, l2), m, mode))
    torch.testing.assert_close(frac, ((l2 > l1).double() * m).sum() / m.sum())
    # verl's current signature: the global normalisers are passed on to agg_loss
    loss, frac2 = verl.compute_value_loss(
        vpreds,
        returns,
        values,
        m,
        0.5,
        mode,
        dp_size=2,
        batch_num_tokens=300,
        global_batch_size=12,
        loss_scale_factor=40,
    )
    torch.testing.assert_close(loss, 0.5 * ref_agg(torch.maximum(l1, l2), m, mode, 2, 300, 12, 40))
    assert frac2 == frac


# --------------------------------------------------------------------------- torch utilities
def test_masked_whiten_matches_and_raises_as_verl():
    gen = _gen(10)
    x = torch.randn(B, T, generator=gen, dtype=torch.float64)
    m = _prefix_mask(gen)
    for shift in (True, False):
        got = verl.masked_whiten(x, m, shift_mean=shift)
        torch.testing.assert_close(got * m, ref_whiten(x, m, shift) * m)
        assert got[m == 0].eq(0).all()
    two = torch.zeros_like(m)
    two[0, 0] = two[3, 5] = 1
    torch.testing.assert_close(verl.masked_whiten(x, two) * two, ref_whiten(x, two) * two)
    # verl's masked_var (unbiased): "At least one element in the mask has to be 1." and "The
    # sum of the mask is one, which can cause a division by zero.", both ValueError.
    one = torch.zeros_like(m)
    one[0, 0] = 1
    for mask, match in (
        (one, "single"),
        (one.bool(), "single"),
        (one.float(), "single"),
        (torch.zeros_like(m), "no entry"),
        (torch.zeros(B, T), "no entry"),
    ):
        with pytest.raises(ValueError, match=match):
            verl.masked_whiten(x, mask)
    const = torch.full((B, T), 0.3, dtype=torch.float32)
    assert torch.isfinite(verl.masked_whiten(const, m)).all()


def test_estimators_give_zero_advantages_where_verls_whitening_raises():
    """Deliberate difference: with 0 or 1 selected token verl's estimators raise (from
    ``masked_whiten``); here the advantages are 0 and the returns are still computed."""
    gen = _gen(31)
    r = torch.randn(B, T, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, generator=gen, dtype=torch.float64)
    one = torch.zeros(B, T, dtype=torch.long)
    one[2, 4] = 1
    for m in (one, torch.zeros_like(one)):
        adv, ret = verl.compute_reinforce_plus_plus_outcome_advantage(r, m, {"gamma": 0.9})
        with pytest.raises(ValueError):
            ref_reinforce(r, m, 0.9)  # verl whitens the returns: raises
        assert adv.eq(0).all()
        assert torch.equal(ret, r * m)  # the one action's return is its own reward
        assert verl.compute_gae_advantage_return(r, v, m, 0.9, 0.9)[0].eq(0).all()
        adv, _ = verl.compute_reinforce_plus_plus_baseline_outcome_advantage(r, m, list(range(B)))
        assert adv.eq(0).all()


def test_logprobs_and_entropy_from_logits():
    gen = _gen(11)
    logits = torch.randn(2, 5, 33, generator=gen) * 3
    labels = torch.randint(0, 33, (2, 5), generator=gen)
    leaf = logits.clone().requires_grad_()
    got = {"logp": verl.logprobs_from_logits(logits, labels), "ent": verl.entropy_from_logits(leaf)}
    (got["grad"],) = torch.autograd.grad(got["ent"].sum(), leaf)
    exact, ref32 = ({}, {})
    for out, dtype in ((exact, torch.float64), (ref32, torch.float32)):
        z = logits.to(dtype).requires_grad_()
        out["logp"] = z.log_softmax(-1).gather(-1, labels[..., None])[..., 0]
        out["ent"] = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
        (out["grad"],) = torch.autograd.grad(out["ent"].sum(), z)
    for name, value in got.items():
        assert_within_reference(name, value.detach(), exact[name].detach(), ref32[name].detach())
    half = verl.logprobs_from_logits(logits.bfloat16(), labels)
    assert half.dtype == torch.float32 and half.shape == (2, 5)


# --------------------------------------------------------------------------- arguments
def test_numpy_and_0d_tensor_scalars_are_accepted():
    """verl passes gamma, lam and clip ranges as np.float32 (and types gamma as a tensor)."""
    gen = _gen(13)
    r = torch.randn(B, T, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, generator=gen, dtype=torch.float64)
    m = _prefix_mask(gen)
    f32 = np.float32
    want = verl.compute_gae_advantage_return(r, v, m, float(f32(0.99)), float(f32(0.95)))
    for gamma, lam in ((f32(0.99), f32(0.95)), (torch.tensor(f32(0.99)), torch.tensor(f32(0.95)))):
        for got, w in zip(verl.compute_gae_advantage_return(r, v, m, gamma, lam), want):
            torch.testing.assert_close(got, w)
    got = verl.compute_reinforce_plus_plus_outcome_advantage(r, m, {"gamma": f32(0.5)})
    for g, w in zip(got, verl.compute_reinforce_plus_plus_outcome_advantage(r, m, {"gamma": 0.5})):
        torch.testing.assert_close(g, w)
    old, new = v, v + 0.1 * r
    want = verl.compute_policy_loss(old, new, r, m, cliprange=0.2, clip_ratio_c=3.0)
    for cast in (f32, torch.tensor):
        got = verl.compute_policy_loss(old, new, r, m, cliprange=cast(0.2), clip_ratio_c=cast(3.0))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)  # 0.2 in float32
        got = verl.compute_value_loss(new, r, old, m, cast(0.5))
        for g, w in zip(got, verl.compute_value_loss(new, r, old, m, 0.5)):
            torch.testing.assert_close(g, w)
    cfg = {"clip_ratio": f32(0.2), "clip_ratio_c": f32(3.0)}
    torch.testing.assert_close(
        verl.compute_policy_loss_vanilla(old, new, r, m, config=cfg)[0],
        want[0],
        rtol=1e-6,
        atol=1e-7,
    )


_X = torch.zeros(2, 3)
_M = torch.ones(2, 3)
BAD_VERL_CALLS = [
    # (call, error type, the verl argument the message must name)
    (
        lambda: verl.compute_policy_loss(_X, _X, _X, _M, cliprange=0.2, clip_ratio_c=1.0),
        ValueError,
        "clip_ratio_c",
    ),
    (lambda: verl.compute_policy_loss(_X, _X, _X, _M, cliprange=-0.2), ValueError, "cliprange"),
    (
        lambda: verl.compute_policy_loss(_X, _X, _X, _M, cliprange=0.2, cliprange_high=-1.0),
        ValueError,
        "cliprange_high",
    ),
    (
        lambda: verl.compute_policy_loss(_X, _X, _X, _M, cliprange=0.2, cliprange_low="a"),
        TypeError,
        "cliprange_low",
    ),
    (
        lambda: verl.compute_policy_loss(_X, torch.zeros(2, 4), _X, _M, cliprange=0.2),
        ValueError,
        "log_prob",
    ),
    (
        lambda: verl.compute_policy_loss(_X, _X, _X, torch.ones(2, 4), cliprange=0.2),
        ValueError,
        "response_mask",
    ),
    (
        lambda: verl.compute_policy_loss(_X, _X, _X, _M, cliprange=0.2, loss_agg_mode="mean"),
        ValueError,
        "loss_agg_mode",
    ),
    (
        lambda: verl.compute_value_loss(_X, _X, _X, _M, cliprange_value=-0.5),
        ValueError,
        "cliprange_value",
    ),
    (lambda: verl.compute_value_loss(_X, torch.zeros(3), _X, _M, 0.5), ValueError, "returns"),
    (lambda: verl.compute_value_loss(_X, _X, _X, _M, 0.5, "sum"), ValueError, "loss_agg_mode"),
    (lambda: verl.agg_loss(_X, _M, "sum"), ValueError, "loss_agg_mode"),
    (lambda: verl.agg_loss(_X, torch.ones(3), "token-mean"), ValueError, "loss_mask"),
    (
        lambda: verl.agg_loss(_X, _M, "seq-mean-token-sum-norm", loss_scale_factor=0),
        ValueError,
        "loss_scale_factor",
    ),
    (lambda: verl.compute_gae_advantage_return(_X, _X, _M, 1.5, 0.9), ValueError, "gamma"),
    (lambda: verl.compute_gae_advantage_return(_X, _X, _M, 0.9, -1.0), ValueError, "lam"),
    (
        lambda: verl.compute_gae_advantage_return(_X, torch.zeros(2, 4), _M, 0.9, 0.9),
        ValueError,
        "values",
    ),
    (
        lambda: verl.compute_gae_advantage_return(_X, _X, torch.ones(2, 4), 0.9, 0.9),
        ValueError,
        "response_mask",
    ),
    (
        lambda: verl.compute_reinforce_plus_plus_outcome_advantage(_X, _M, {"gamma": 2.0}),
        ValueError,
        "gamma",
    ),
    (
        lambda: verl.compute_grpo_outcome_advantage(_X, _M, [0, 0], epsilon=-1.0),
        ValueError,
        "epsilon",
    ),
    (
        lambda: verl.compute_grpo_outcome_advantage(_X, torch.ones(2, 4), [0, 0]),
        ValueError,
        "response_mask",
    ),
    (
        lambda: verl.compute_remax_outcome_advantage(_X, torch.zeros(3), _M),
        ValueError,
        "reward_baselines",
    ),
    (lambda: verl.kl_penalty(_X, _X, "k9"), ValueError, "kl_penalty"),
    (lambda: verl.kl_penalty(_X, torch.zeros(2, 4), "k1"), ValueError, "ref_logprob"),
    (lambda: verl.masked_whiten(_X, torch.ones(2, 4)), ValueError, "mask"),
]


@pytest.mark.parametrize("i", range(len(BAD_VERL_CALLS)))
def test_bad_input_names_verls_argument(i):
    call, err, name = BAD_VERL_CALLS[i]
    with pytest.raises(err, match=name):
        call()


def test_exports_are_pinned_and_documented():
    assert verl.__all__ == sorted(verl.__all__)
    assert verl.__all__ == [
        "POLICY_LOSS_REGISTRY",
        "agg_loss",
        "compute_forward_kl_topk",
        "compute_gae_advantage_return",
        "compute_gdpo_outcome_advantage",
        "compute_gpg_outcome_advantage",
        "compute_grpo_outcome_advantage",
        "compute_grpo_passk_outcome_advantage",
        "compute_is_metrics",
        "compute_multi_turn_optimal_token_baseline_advantage",
        "compute_offpolicy_metrics",
        "compute_opo_outcome_advantage",
        "compute_optimal_token_baseline_advantage",
        "compute_policy_loss",
        "compute_policy_loss_bypass_mode",
        "compute_policy_loss_cispo",
        "compute_policy_loss_clip_cov",
        "compute_policy_loss_dppo_kl",
        "compute_policy_loss_dppo_tv",
        "compute_policy_loss_geo_mean",
        "compute_policy_loss_gpg",
        "compute_policy_loss_gspo",
        "compute_policy_loss_kl_cov",
        "compute_policy_loss_sapo",
        "compute_policy_loss_vanilla",
        "compute_reinforce_plus_plus_baseline_outcome_advantage",
        "compute_reinforce_plus_plus_outcome_advantage",
        "compute_remax_outcome_advantage",
        "compute_rloo_outcome_advantage",
        "compute_rollout_correction_and_rejection_mask",
        "compute_rollout_correction_weights",
        "compute_rollout_rejection_mask",
        "compute_rs_metrics",
        "compute_value_loss",
        "entropy_from_logits",
        "get_policy_loss_fn",
        "kl_penalty",
        "logprobs_from_logits",
        "masked_whiten",
    ]
    for name in verl.__all__:
        if name == "POLICY_LOSS_REGISTRY":  # data: verl's name -> adapter
            continue
        doc = getattr(verl, name).__doc__
        assert doc and ">>>" in doc, name
