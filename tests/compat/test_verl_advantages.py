"""verl's OPO, GPG, GRPO pass@k, GDPO and OTB estimators (``rlops.compat.verl``) against
verl's formulas written plainly here (verl is not installed): loops over samples and groups as
verl's own code runs them, in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.advantages.test_group import ref_otb

from rlops.compat import verl


def _batch(seed=0, b=10, t=7):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.zeros(b, t, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    scores = torch.randint(0, 4, (b,), generator=g).double() / 2
    rewards[torch.arange(b), lengths - 1] = scores
    uids = np.array(["p", "p", "p", "q", "q", "r", "s", "s", "s", "s"][:b], dtype=object)
    return rewards, mask, uids


def _groups(uids):
    out: dict = {}
    for i, u in enumerate(uids):
        out.setdefault(u, []).append(i)
    return out


def verl_opo(rewards, mask, uids):
    scores = rewards.sum(-1).clone()
    length = mask.sum(-1).double()
    base = {}
    for u, rows in _groups(uids).items():
        base[u] = (
            0.0
            if len(rows) == 1
            else float((length[rows] * scores[rows]).sum() / length[rows].sum())
        )
    for i, u in enumerate(uids):
        scores[i] -= base[u]
    return scores[:, None] * mask


def verl_gpg(rewards, mask, uids, f_norm):
    scores = rewards.sum(-1).clone()
    alpha = len(scores) / max(int((scores != 0).sum()), 1)
    mean = {u: (0.0 if len(r) == 1 else float(scores[r].mean())) for u, r in _groups(uids).items()}
    out = torch.tensor(
        [alpha * (float(scores[i]) - mean[u]) / f_norm for i, u in enumerate(uids)],
        dtype=torch.float64,
    )
    return out[:, None] * mask


def verl_passk(rewards, mask, uids, norm, eps=1e-6):
    scores = rewards.sum(-1)
    adv = torch.zeros_like(scores)
    for rows in _groups(uids).values():
        s = scores[rows]
        top = torch.topk(s, 2).values
        a = top[0] - top[1]
        if norm:
            a = a / (s.std() + eps)
        if top[0] > top[1]:  # a tie gives 0 whichever sample topk picks
            adv[rows[int(torch.argmax(s))]] = a
    return adv[:, None] * mask


def test_opo_gpg_passk_match_verl():
    rewards, mask, uids = _batch()
    adv, ret = verl.compute_opo_outcome_advantage(rewards, mask, uids)
    torch.testing.assert_close(adv, verl_opo(rewards, mask, uids))
    assert ret is adv
    for f_norm in (1.0, 2.5):
        adv, _ = verl.compute_gpg_outcome_advantage(
            rewards, mask, uids, f_norm=f_norm, alpha=123.0
        )  # verl ignores alpha
        torch.testing.assert_close(adv, verl_gpg(rewards, mask, uids, f_norm))
    uids = np.array(["p", "p", "p", "q", "q", "q", "s", "s", "s", "s"], dtype=object)  # n >= 2
    for norm in (True, False):
        adv, _ = verl.compute_grpo_passk_outcome_advantage(
            rewards, mask, uids, config={"norm_adv_by_std_in_grpo": norm}
        )
        torch.testing.assert_close(adv, verl_passk(rewards, mask, uids, norm))
        # without a config the argument decides
        adv2, _ = verl.compute_grpo_passk_outcome_advantage(
            rewards, mask, uids, norm_adv_by_std_in_grpo=norm
        )
        torch.testing.assert_close(adv2, adv)


def verl_gdpo(score_list, mask, uids, weights, norm, eps=1e-6):
    total = torch.zeros(mask.shape, dtype=torch.float64)
    for w, scores in zip(weights, score_list, strict=True):
        a = torch.zeros(len(scores), dtype=torch.float64)
        for rows in _groups(uids).values():
            s = scores[rows]
            mu, sd = (0.0, 1.0) if len(rows) == 1 else (s.mean(), s.std())
            a[rows] = (s - mu) / (sd + eps) if norm else s - mu
        total += w * a[:, None] * mask
    x = total[mask]
    out = (total - x.mean()) * torch.rsqrt(x.var() + 1e-8)
    return out * mask


@pytest.mark.parametrize("norm", [True, False])
def test_gdpo_matches_verl_with_reward_keys(norm):
    rewards, mask, uids = _batch(2)
    g = torch.Generator().manual_seed(9)
    fmt = (torch.rand(len(uids), generator=g) < 0.5).double()
    acc = torch.randn(len(uids), generator=g, dtype=torch.float64) * 10
    config = {"gdpo_reward_keys": ["format", "accuracy"], "gdpo_reward_weights": [1.0, 0.5]}
    ntb = {"format": fmt.numpy(), "accuracy": acc.numpy()}
    adv, _ = verl.compute_gdpo_outcome_advantage(
        rewards,
        mask,
        uids,
        norm_adv_by_std_in_grpo=norm,
        config=config,
        non_tensor_batch=ntb,
        batch={"prompts": None},
    )
    ref = verl_gdpo([fmt.float().double(), acc.float().double()], mask, uids, [1.0, 0.5], norm)
    torch.testing.assert_close(adv.double(), ref, rtol=1e-5, atol=1e-6)  # float32 scores
    # without reward keys: the one component is the row sum of the token rewards
    adv, _ = verl.compute_gdpo_outcome_advantage(rewards, mask, uids, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(adv, verl_gdpo([rewards.sum(-1)], mask, uids, [1.0], norm))


@pytest.mark.parametrize("tir", [False, True])
def test_optimal_token_baseline_matches_verl(tir):
    rewards, mask, uids = _batch(4, t=9)
    if tir:
        mask[:, 1] = False
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(mask.shape, generator=g, dtype=torch.float64)
    spp = torch.rand(mask.shape, generator=g, dtype=torch.float64) * 0.3 + 0.1
    isw = torch.rand(mask.shape, generator=g, dtype=torch.float64) + 0.5
    fn = (
        verl.compute_multi_turn_optimal_token_baseline_advantage
        if tir
        else verl.compute_optimal_token_baseline_advantage
    )
    adv, ret = fn(rewards, mask, uids, logp, spp, rollout_is_weights=isw)
    ids = torch.as_tensor(np.unique(uids, return_inverse=True)[1])
    r_adv, r_ret = ref_otb(rewards, ids, mask, logp, spp, isw, True, 1e-8, tir)
    torch.testing.assert_close(adv, r_adv)
    torch.testing.assert_close(ret, r_ret)
