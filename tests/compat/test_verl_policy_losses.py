"""verl's registered policy losses (``rlops.compat.verl.POLICY_LOSS_REGISTRY``) against plain
restatements of verl's formulas (``core_algos.compute_policy_loss_<name>``: loops over rows and
tokens in float64, written from the formulas, not from rlops), hand-computed cases, verl's
signature, and bad input naming verl's config keys (``dppo_*`` and ``bypass_mode`` too)."""

from __future__ import annotations

import inspect
import math
import re
from types import SimpleNamespace

import pytest
import torch
from tests._bad_input import names

from rlops.compat import verl

B, T = 5, 9


def _batch(seed: int = 0, per_row_adv: bool = False):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    new = (old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    if per_row_adv:
        adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    else:
        adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    n = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < n[:, None]).long()
    mask[1, 2:4] = 0  # a tool span inside a row
    mask[-1] = 0  # a row with no response token
    w = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5
    return old, new, adv, mask, w


def _config(**kw):
    policy_loss = SimpleNamespace(
        clip_cov_ratio=kw.pop("clip_cov_ratio", None),
        clip_cov_lb=kw.pop("clip_cov_lb", None),
        clip_cov_ub=kw.pop("clip_cov_ub", None),
        kl_cov_ratio=kw.pop("kl_cov_ratio", None),
        ppo_kl_coef=kw.pop("ppo_kl_coef", None),
        rollout_correction={"rollout_is": "token"},
    )
    base = dict(
        clip_ratio=0.2,
        clip_ratio_low=None,
        clip_ratio_high=None,
        clip_ratio_c=3.0,
        tau_pos=1.0,
        tau_neg=1.05,
        global_batch_info={},
        policy_loss=policy_loss,
    )
    base.update(kw)
    return SimpleNamespace(**base)


# --------------------------------------------------------------------------- restatements
def ref_agg(loss, mask, mode):
    """verl's agg_loss on one rank: token-mean, token-sum, seq-mean-token-sum(-norm),
    seq-mean-token-mean (rows with no response token left out)."""
    total, n_tok, rows, row_sum = 0.0, 0, 0, 0.0
    for i in range(loss.shape[0]):
        s, c = 0.0, 0
        for t in range(loss.shape[1]):
            if mask[i, t]:
                s, c = s + loss[i, t], c + 1
        total, n_tok = total + s, n_tok + c
        if c:
            rows += 1
            row_sum = row_sum + (s / c if mode == "seq-mean-token-mean" else s)
    if mode == "token-mean":
        return total / n_tok
    if mode == "token-sum":
        return total
    out = row_sum / rows
    return out / loss.shape[1] if mode == "seq-mean-token-sum-norm" else out


def masked_mean_loop(x, mask):
    vals = [x[i, t] for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t]]
    return sum(vals) / len(vals)


def ref_gspo(old, new, adv, mask, lo, hi, w=None):
    loss = torch.zeros_like(new)
    clipped = torch.zeros_like(old)
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t]]
        seq = sum((new[i, t] - old[i, t]).detach() for t in idx) / max(len(idx), 1)
        for t in idx:
            log_s = new[i, t] - new[i, t].detach() + seq  # value s_i, gradient s_i·∇log π_t
            s = torch.exp(torch.clamp(log_s, max=10.0))
            l1, l2 = -adv[i, t] * s, -adv[i, t] * torch.clamp(s, 1 - lo, 1 + hi)
            loss[i, t] = torch.maximum(l1, l2) * (1.0 if w is None else w[i, t])
            clipped[i, t] = float(l2 > l1)
    return ref_agg(loss, mask, "seq-mean-token-mean"), masked_mean_loop(clipped, mask)


def ref_sapo(old, new, adv, mask, tau_pos, tau_neg):
    loss = torch.zeros_like(new)
    for i in range(B):
        for t in range(T):
            r = torch.exp(new[i, t] - old[i, t])
            tau = tau_pos if adv[i, t] > 0 else tau_neg
            loss[i, t] = -torch.sigmoid(tau * (r - 1)) * 4 / tau * adv[i, t]
    return ref_agg(loss, mask, "seq-mean-token-mean")


def ref_cispo(old, new, adv, mask, lo, hi, mode):
    loss = torch.zeros_like(new)
    clipped = torch.zeros_like(old)
    for i in range(B):
        for t in range(T):
            r = math.exp(float(new[i, t].detach() - old[i, t]))
            c = min(max(r, 1 - lo), 1 + hi)
            loss[i, t] = -c * adv[i, t] * new[i, t]
            clipped[i, t] = float(c != r)
    return ref_agg(loss, mask, mode), masked_mean_loop(clipped, mask)


def ref_kl_cov(old, new, adv, mask, ratio, coef, mode):
    pos = [(i, t) for i in range(B) for t in range(T) if mask[i, t]]
    a = [float(adv[i, t]) for i, t in pos]
    p = [float(new.detach()[i, t]) for i, t in pos]
    ma, mp = sum(a) / len(a), sum(p) / len(p)
    cov = [(x - ma) * (y - mp) for x, y in zip(a, p)]
    k = max(1, int(len(cov) * ratio))
    top = sorted(range(len(cov)), key=lambda j: -cov[j])[:k]
    chosen = {pos[j] for j in top}
    loss = torch.zeros_like(new)
    for i in range(B):
        for t in range(T):
            lr = new[i, t] - old[i, t]
            loss[i, t] = -adv[i, t] * torch.exp(lr) + (coef * lr.abs() if (i, t) in chosen else 0)
    abs_kl = masked_mean_loop((new - old).abs().detach(), mask)
    return ref_agg(loss, mask, mode), abs_kl


def ref_geo_mean(old, new, adv, mask, lo, hi, w=None):
    """GMPO as verl: per row −Ā·exp(Σ m·l / (n + 1e-8)), l pessimistically clipped per token;
    a plain mean over all rows; IS weights reduced to their geometric mean per row."""
    rows = []
    for i in range(B):
        n = sum(int(mask[i, t]) for t in range(T))
        s = new.new_zeros(())
        a_sum = 0.0
        lw = 0.0
        for t in range(T):
            if not mask[i, t]:
                continue
            lr = new[i, t] - old[i, t]
            sgn = float(torch.sign(adv[i, t]))
            lc = torch.clamp(lr, -lo, hi)
            s = s + sgn * torch.minimum(sgn * lr, sgn * lc)
            a_sum += float(adv[i, t])
            if w is not None:
                lw += math.log(float(w[i, t]) + 1e-10)
        row = -(a_sum / (n + 1e-8)) * torch.exp(s / (n + 1e-8))
        if w is not None:
            row = row * math.exp(lw / (n + 1e-8))
        rows.append(row)
    return sum(rows) / B


# --------------------------------------------------------------------------- values
def _call(name, old, new, adv, mask, cfg, mode="token-mean", w=None):
    return verl.get_policy_loss_fn(name)(old, new, adv, mask, mode, cfg, w)


@pytest.mark.parametrize("weights", [False, True])
def test_gspo_matches_verl_formula_value_and_gradient(weights):
    old, new, adv, mask, w = _batch(1, per_row_adv=True)
    w = w if weights else None
    cfg = _config(clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    # loss_agg_mode is ignored: verl aggregates GSPO with seq-mean-token-mean
    loss, m = _call("gspo", old, new, adv, mask, cfg, mode="token-mean", w=w)
    ref, clipfrac = ref_gspo(old, new, adv, mask, 3e-4, 4e-4, w)
    torch.testing.assert_close(loss, ref)
    (g,) = torch.autograd.grad(loss, new)
    (g_ref,) = torch.autograd.grad(ref, new)
    torch.testing.assert_close(g, g_ref)
    assert m["actor/pg_clipfrac"] == pytest.approx(float(clipfrac))
    assert m["actor/ppo_kl"] == pytest.approx(float(masked_mean_loop(old - new.detach(), mask)))
    assert m["actor/pg_clipfrac_lower"] == 0.0


def test_sapo_matches_verl_formula():
    old, new, adv, mask, _ = _batch(2)
    cfg = _config(tau_pos=1.3, tau_neg=2.0)
    loss, m = _call("sapo", old, new, adv, mask, cfg, mode="token-sum")
    ref = ref_sapo(old, new, adv, mask, 1.3, 2.0)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss, new)[0], torch.autograd.grad(ref, new)[0])
    assert m["actor/pg_clipfrac"] == 0.0 and m["actor/pg_clipfrac_lower"] == 0.0


@pytest.mark.parametrize(
    "mode",
    [
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-sum",
    ],
)
def test_gpg_and_cispo_follow_loss_agg_mode(mode):
    old, new, adv, mask, _ = _batch(3)
    loss, m = _call("gpg", old, new, adv, mask, _config(), mode=mode)
    ref = ref_agg(-new * adv, mask, mode)
    torch.testing.assert_close(loss, ref)
    assert m == {}
    cfg = _config(clip_ratio_low=0.1, clip_ratio_high=0.3)
    loss, m = _call("cispo", old, new, adv, mask, cfg, mode=mode)
    ref, clipfrac = ref_cispo(old, new, adv, mask, 0.1, 0.3, mode)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss, new)[0], torch.autograd.grad(ref, new)[0])
    assert m["actor/pg_clipfrac"] == pytest.approx(float(clipfrac))


def test_rollout_is_weights_multiply_each_token_before_aggregation():
    old, new, adv, mask, w = _batch(4)
    loss, _ = _call("gpg", old, new, adv, mask, _config(), "token-sum", w)
    torch.testing.assert_close(loss, ref_agg(-new * adv * w, mask, "token-sum"))
    loss, _ = _call("sapo", old, new, adv, mask, _config(), "token-sum", w)
    torch.testing.assert_close(
        loss, ref_agg(_sapo_mat(old, new, adv) * w, mask, "seq-mean-token-mean")
    )
    cfg = _config(clip_ratio_low=0.1, clip_ratio_high=0.3)
    loss, _ = _call("cispo", old, new, adv, mask, cfg, "token-mean", w)
    ref = ref_agg(_cispo_mat(old, new, adv, 0.1, 0.3) * w, mask, "token-mean")
    torch.testing.assert_close(loss, ref)


def _cispo_mat(old, new, adv, lo, hi):
    out = torch.zeros_like(new)
    for i in range(B):
        for t in range(T):
            r = math.exp(float(new[i, t].detach() - old[i, t]))
            out[i, t] = -min(max(r, 1 - lo), 1 + hi) * adv[i, t] * new[i, t]
    return out


def _sapo_mat(old, new, adv):
    out = torch.zeros_like(new)
    for i in range(B):
        for t in range(T):
            r = torch.exp(new[i, t] - old[i, t])
            tau = 1.0 if adv[i, t] > 0 else 1.05
            out[i, t] = -torch.sigmoid(tau * (r - 1)) * 4 / tau * adv[i, t]
    return out


def test_clip_cov_zeroes_every_candidate_when_the_quota_covers_them():
    old, new, adv, mask, _ = _batch(5)
    lb, ub = 0.05, 5.0
    cfg = _config(clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub)
    loss, m = _call("clip_cov", old, new, adv, mask, cfg)
    # verl: cov = (A − mean A)·(log π − mean log π) over response tokens; candidates are the
    # tokens PPO does not clip with lb < cov < ub; all of them (quota N) get loss 0
    pos = [(i, t) for i in range(B) for t in range(T) if mask[i, t]]
    ma = sum(float(adv[p]) for p in pos) / len(pos)
    mp = sum(float(new.detach()[p]) for p in pos) / len(pos)
    mat = torch.zeros_like(new)
    zeroed = 0
    for i, t in pos:
        r = torch.exp(new[i, t] - old[i, t])
        l1, l2 = -adv[i, t] * r, -adv[i, t] * torch.clamp(r, 0.8, 1.2)
        cov = (float(adv[i, t]) - ma) * (float(new.detach()[i, t]) - mp)
        if not l2 > l1 and lb < cov < ub:
            zeroed += 1
            continue
        mat[i, t] = torch.maximum(l1, l2)
    assert zeroed > 0
    torch.testing.assert_close(loss, ref_agg(mat, mask, "token-mean"))
    assert m["actor/pg_clipfrac"] == pytest.approx(zeroed / len(pos))
    assert m["actor/ppo_kl"] == pytest.approx(float(masked_mean_loop(old - new.detach(), mask)))


def test_clip_cov_quota_is_verls():
    old, new, adv, mask, _ = _batch(6)
    n = int(mask.sum())
    cfg = _config(clip_cov_ratio=0.1, clip_cov_lb=-100.0, clip_cov_ub=100.0)
    _, m = _call("clip_cov", old, new, adv, mask, cfg)
    # max(int(0.1·N), 1) of the (many) candidates
    assert m["actor/pg_clipfrac"] == pytest.approx(max(int(0.1 * n), 1) / n)


@pytest.mark.parametrize("ratio,coef", [(0.2, 1.0), (1e-4, 0.1)])
def test_kl_cov_matches_verl_formula(ratio, coef):
    old, new, adv, mask, _ = _batch(7)
    cfg = _config(kl_cov_ratio=ratio, ppo_kl_coef=coef)
    loss, m = _call("kl_cov", old, new, adv, mask, cfg, mode="seq-mean-token-sum")
    ref, abs_kl = ref_kl_cov(old, new, adv, mask, ratio, coef, "seq-mean-token-sum")
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss, new)[0], torch.autograd.grad(ref, new)[0])
    assert m == {"actor/ppo_kl": pytest.approx(float(abs_kl))}


@pytest.mark.parametrize("weights", [False, True])
def test_geo_mean_matches_verl_formula(weights):
    old, new, adv, mask, w = _batch(8, per_row_adv=True)
    w = w if weights else None
    cfg = _config(clip_ratio=0.4, clip_ratio_high=0.3, global_batch_info={"dp_size": 4})
    loss, m = _call("geo_mean", old, new, adv, mask, cfg, mode="token-sum", w=w)
    ref = ref_geo_mean(old, new, adv, mask, 0.4, 0.3, w)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss, new)[0], torch.autograd.grad(ref, new)[0])
    lr = (new - old).detach()
    out = (lr < -0.4) | (lr > 0.3)
    assert m["actor/pg_clipfrac"] == pytest.approx(float(masked_mean_loop(out & (adv > 0), mask)))
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(
        float(masked_mean_loop(out & (adv < 0), mask))
    )


def test_geo_mean_value_is_verls_with_per_token_advantages():
    old, new, adv, mask, _ = _batch(9)
    loss, _ = _call("geo_mean", old, new, adv, mask, _config(clip_ratio=0.4))
    torch.testing.assert_close(loss, ref_geo_mean(old, new, adv, mask, 0.4, 0.4))


def test_hand_computed_cases():
    one = torch.ones(1, 2)
    # gspo: log-ratios 0.2 and 0 -> s = e^0.1 = 1.10517 > 1 + 4e-4: clipped, A = 1
    loss, m = verl.compute_policy_loss_gspo(
        torch.zeros(1, 2),
        torch.tensor([[0.2, 0.0]]),
        one,
        one,
        config=_config(clip_ratio_low=3e-4, clip_ratio_high=4e-4),
    )
    assert loss.item() == pytest.approx(-1.0004) and m["actor/pg_clipfrac"] == 1.0
    # sapo at r = 1: gate σ(0)·4/τ = 2/τ; A = +1 -> −2/τ_pos, A = −1 -> +2/τ_neg
    loss, _ = verl.compute_policy_loss_sapo(
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.tensor([[1.0, -1.0]]),
        one,
        config=_config(tau_pos=2.0, tau_neg=4.0),
    )
    assert loss.item() == pytest.approx((-1.0 + 0.5) / 2)
    # cispo: r = e^0.5 = 1.6487 -> weight 1.2; loss −1.2·A·log π = −1.2·1·0.5
    loss, m = verl.compute_policy_loss_cispo(
        torch.zeros(1, 1),
        torch.tensor([[0.5]]),
        torch.ones(1, 1),
        torch.ones(1, 1),
        config=_config(),
    )
    assert loss.item() == pytest.approx(-0.6) and m["actor/pg_clipfrac"] == 1.0
    # geo_mean: log-ratios 0.5 and 0.1, A = 1, clip_high 0.4 -> mean(0.4, 0.1) = 0.25
    loss, m = verl.compute_policy_loss_geo_mean(
        torch.zeros(1, 2), torch.tensor([[0.5, 0.1]]), one, one, config=_config(clip_ratio=0.4)
    )
    assert loss.item() == pytest.approx(-math.exp(0.25), rel=1e-6)
    assert m["actor/pg_clipfrac"] == 0.5
    # kl_cov: one token chosen (quota 1), the one of largest cov
    adv = torch.tensor([[1.0, -1.0]])
    new = torch.tensor([[0.0, -1.0]])  # cov: (1)(0.5)=0.5 and (−1)(−0.5)=0.5 -> tie, first
    loss, m = verl.compute_policy_loss_kl_cov(
        torch.zeros(1, 2), new, adv, one, config=_config(ppo_kl_coef=2.0)
    )
    assert loss.item() == pytest.approx((-1.0 + math.exp(-1.0) + 0.0) / 2)
    assert m["actor/ppo_kl"] == pytest.approx(0.5)


def test_global_batch_info_reaches_agg_loss():
    old, new, adv, mask, _ = _batch(10)
    info = {"dp_size": 4, "batch_num_tokens": 100, "global_batch_size": 16}
    loss, _ = _call("gpg", old, new, adv, mask, _config(global_batch_info=info))
    total = sum(
        float(-new[i, t].detach() * adv[i, t]) for i in range(B) for t in range(T) if mask[i, t]
    )
    assert loss.item() == pytest.approx(total / 100 * 4)
    loss, _ = _call("sapo", old, new, adv, mask, _config(global_batch_info=info))
    mat = _sapo_mat(old, new, adv)
    rows = [
        sum(float(mat[i, t].detach()) for t in range(T) if mask[i, t]) / int(mask[i].sum())
        for i in range(B)
        if mask[i].any()
    ]
    assert loss.item() == pytest.approx(sum(rows) / 16 * 4)


# --------------------------------------------------------------------------- signature, registry
VERL_PARAMS = [
    "old_log_prob",
    "log_prob",
    "advantages",
    "response_mask",
    "loss_agg_mode",
    "config",
    "rollout_is_weights",
]


@pytest.mark.parametrize("name", sorted(verl.POLICY_LOSS_REGISTRY))
def test_signature_is_verls(name):
    fn = verl.get_policy_loss_fn(name)
    params = inspect.signature(fn).parameters
    assert list(params) == VERL_PARAMS
    default = "seq-mean-token-mean" if name in ("gspo", "sapo") else "token-mean"
    assert params["loss_agg_mode"].default == default
    assert params["config"].default is None and params["rollout_is_weights"].default is None
    old, new, adv, mask, w = _batch(11)
    cfg = _config()
    by_keyword = fn(
        old_log_prob=old,
        log_prob=new,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="token-mean",
        config=cfg,
        rollout_is_weights=w,
    )
    positional = fn(old, new, adv, mask, "token-mean", cfg, w)
    if name != "clip_cov":  # clip_cov draws a random subset
        torch.testing.assert_close(by_keyword[0], positional[0])
    assert all(isinstance(v, float) for v in by_keyword[1].values())


def test_registry_lists_verls_names_that_rlops_has():
    assert sorted(verl.POLICY_LOSS_REGISTRY) == [
        "bypass_mode",
        "cispo",
        "clip_cov",
        "dppo_kl",
        "dppo_tv",
        "geo_mean",
        "gpg",
        "gspo",
        "kl_cov",
        "sapo",
        "vanilla",
    ]
    for name in ("dro", "nope"):
        with pytest.raises(ValueError, match="Unsupported loss mode"):
            verl.get_policy_loss_fn(name)


def test_dict_config_works_like_attribute_config():
    old, new, adv, mask, _ = _batch(12)
    attr = _config(clip_ratio_high=0.28)
    plain = {"clip_ratio": 0.2, "clip_ratio_high": 0.28}
    for name in ("cispo", "gspo", "geo_mean"):
        a = _call(name, old, new, adv, mask, attr)
        d = _call(name, old, new, adv, mask, plain)
        torch.testing.assert_close(a[0], d[0])
        assert a[1] == d[1]


def test_a_key_set_to_none_reads_as_verl_reads_it():
    """verl's actor config: an absent key takes the field's default; a key set to None falls
    back where verl writes ``x if x is not None else default`` (clip_ratio_low / _high, the
    policy_loss options) and fails where verl reads it as a number (tau_pos, clip_ratio_c) or
    spreads it (global_batch_info). The verl and kind adapters read the config the same way."""
    old, new, adv, mask, _ = _batch(13)
    # clip_ratio_low / clip_ratio_high = None -> clip_ratio, in every adapter that reads them
    for name in ("vanilla", "gspo", "cispo", "geo_mean"):
        fn = verl.get_policy_loss_fn(name)
        unset = fn(old, new, adv, mask, config=_config(clip_ratio=0.3))
        given = fn(
            old,
            new,
            adv,
            mask,
            config=_config(clip_ratio=0.3, clip_ratio_low=0.3, clip_ratio_high=0.3),
        )
        torch.testing.assert_close(unset[0], given[0], rtol=0, atol=0)
    # policy_loss.* = None -> verl's fallbacks (2e-4, 1, 5; 2e-4, 1)
    unset = _call("kl_cov", old, new, adv, mask, _config())
    given = _call("kl_cov", old, new, adv, mask, _config(kl_cov_ratio=2e-4, ppo_kl_coef=1.0))
    torch.testing.assert_close(unset[0], given[0], rtol=0, atol=0)
    # absent keys -> the ActorConfig defaults (tau 1.0 / 1.05, clip_ratio_c 3.0, no batch info)
    absent = _call("sapo", old, new, adv, mask, {})
    given = _call("sapo", old, new, adv, mask, {"tau_pos": 1.0, "tau_neg": 1.05})
    torch.testing.assert_close(absent[0], given[0], rtol=0, atol=0)
    absent = verl.compute_policy_loss_vanilla(old, new, adv, mask, config={"clip_ratio": 0.2})
    given = verl.compute_policy_loss_vanilla(
        old,
        new,
        adv,
        mask,
        config={"clip_ratio": 0.2, "clip_ratio_c": 3.0, "global_batch_info": {}},
    )
    torch.testing.assert_close(absent[0], given[0], rtol=0, atol=0)
    # None where verl has no fallback: an error naming the key, in both adapters
    with pytest.raises(TypeError, match="tau_pos"):
        _call("sapo", old, new, adv, mask, _config(tau_pos=None))
    with pytest.raises(TypeError, match="clip_ratio_c"):
        verl.compute_policy_loss_vanilla(old, new, adv, mask, config=_config(clip_ratio_c=None))
    for name in ("vanilla", "gpg", "sapo"):
        with pytest.raises(TypeError, match="global_batch_info"):
            verl.get_policy_loss_fn(name)(
                old, new, adv, mask, config=_config(global_batch_info=None)
            )
    with pytest.raises(ValueError, match="policy_loss"):
        _call("kl_cov", old, new, adv, mask, _config(policy_loss=None))


_O = torch.zeros(2, 3)
_M = torch.ones(2, 3)
BAD = [
    ("gspo", dict(config=None), ValueError, "config"),
    ("cispo", dict(config=_config(clip_ratio=-0.1)), ValueError, "clip_ratio"),
    ("gspo", dict(config=_config(clip_ratio_high=0.0)), ValueError, "clip_ratio_high"),
    ("cispo", dict(config={"clip_ratio_low": 0.2}), ValueError, "clip_ratio_high"),
    ("sapo", dict(config=_config(tau_pos=0.0)), ValueError, "tau_pos"),
    ("sapo", dict(config=_config(tau_neg=-1.0)), ValueError, "tau_neg"),
    ("clip_cov", dict(config=_config(clip_cov_ratio=2.0)), ValueError, "clip_cov_ratio"),
    ("clip_cov", dict(config=_config(clip_cov_lb=5.0, clip_cov_ub=1.0)), ValueError, "clip_cov_lb"),
    ("kl_cov", dict(config=_config(kl_cov_ratio=-1.0)), ValueError, "kl_cov_ratio"),
    ("kl_cov", dict(config=_config(ppo_kl_coef=-1.0)), ValueError, "ppo_kl_coef"),
    ("gpg", dict(log_prob=torch.zeros(2, 4)), ValueError, "log_prob"),
    ("geo_mean", dict(advantages=torch.zeros(3)), ValueError, "advantages"),
    ("gspo", dict(response_mask=torch.ones(2, 4)), ValueError, "response_mask"),
    ("cispo", dict(rollout_is_weights=torch.ones(1, 3)), ValueError, "rollout_is_weights"),
    ("gpg", dict(loss_agg_mode="mean"), ValueError, "loss_agg_mode"),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_input_names_verls_argument(i):
    name, override, err, word = BAD[i]
    args = dict(
        old_log_prob=_O,
        log_prob=_O,
        advantages=_O,
        response_mask=_M,
        loss_agg_mode="token-mean",
        config=_config(),
        rollout_is_weights=None,
    )
    args.update(override)
    with pytest.raises(err, match=word):
        verl.get_policy_loss_fn(name)(**args)


# ------------------------------------------------------------------ bad input: dppo, bypass_mode
BB, TT = 3, 4  # (the shapes the messages below name)


def _tensors():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(BB, TT, generator=g) - 0.1
    old = -torch.rand(BB, TT, generator=g) - 0.1
    return old, logp, torch.randn(BB, TT, generator=g), torch.ones(BB, TT)


def bypass(**rc):
    config = {"clip_ratio": 0.2, "policy_loss": {"rollout_correction": rc}}
    return verl.compute_policy_loss_bypass_mode(*_tensors(), config=config)


BAD_BYPASS = [
    (
        {"loss_type": "pg"},
        ValueError,
        "config.policy_loss.rollout_correction.loss_type",
        "'ppo_clip', 'reinforce'",
    ),
    (
        {"loss_type": None},
        ValueError,
        "config.policy_loss.rollout_correction.loss_type",
        "'ppo_clip', 'reinforce'",
    ),
    ({"rollout_is": "tokens"}, ValueError, "rollout_is", "'token', 'sequence'"),
    (
        {"rollout_is": "token", "rollout_is_threshold": math.nan},
        ValueError,
        "rollout_is_threshold",
        "positive",
    ),
    (
        {"rollout_is": "token", "rollout_is_threshold": -2.0},
        ValueError,
        "rollout_is_threshold",
        "positive",
    ),
    (
        {"rollout_is": "token", "rollout_is_batch_normalize": "yes"},
        TypeError,
        "rollout_is_batch_normalize",
        "bool",
    ),
    ({"rollout_rs": "token_k1"}, ValueError, "rollout_rs_threshold", "must be given"),
    (
        {"rollout_rs": "token_k1", "rollout_rs_threshold": math.nan},
        ValueError,
        "rollout_rs_threshold",
        "positive",
    ),
]


@pytest.mark.parametrize(
    ("rc", "exc", "arg", "words"), BAD_BYPASS, ids=[f"{i}" for i in range(len(BAD_BYPASS))]
)
def test_bypass_mode_bad_rollout_correction_option_names_it(rc, exc, arg, words):
    with pytest.raises(exc, match=names(arg)) as info:
        bypass(**rc)
    assert words in str(info.value)


def test_bypass_mode_without_its_config_names_it():
    with pytest.raises(ValueError, match=names("config")):
        verl.compute_policy_loss_bypass_mode(*_tensors())
    with pytest.raises(ValueError, match=re.escape("config.policy_loss.rollout_correction")):
        verl.compute_policy_loss_bypass_mode(*_tensors(), config={"clip_ratio": 0.2})


def test_bypass_mode_integer_log_prob_names_it():
    old, logp, adv, mask = _tensors()
    with pytest.raises(TypeError, match=r"\blog_prob must be a floating-point tensor"):
        verl.compute_policy_loss_bypass_mode(
            old, logp.long(), adv, mask, config={"policy_loss": {"rollout_correction": {}}}
        )


@pytest.mark.parametrize("fn", [verl.compute_policy_loss_dppo_tv, verl.compute_policy_loss_dppo_kl])
@pytest.mark.parametrize(
    ("config", "exc", "arg", "words"),
    [
        ({"clip_ratio": "x"}, TypeError, "config.clip_ratio", "real number"),
        ({"clip_ratio": math.nan}, ValueError, "config.clip_ratio", "> 0"),
        ({"clip_ratio": 0.2, "clip_ratio_low": -1.0}, ValueError, "config.clip_ratio_low", "> 0"),
        ({"clip_ratio": 0.2, "clip_ratio_high": 0.0}, ValueError, "config.clip_ratio_high", "> 0"),
        ({"clip_ratio": 0.2, "clip_ratio_c": math.nan}, ValueError, "config.clip_ratio_c", "> 0"),
        (
            {"clip_ratio": 0.2, "clip_ratio_c": None},
            TypeError,
            "config.clip_ratio_c",
            "real number",
        ),
    ],
)
def test_dppo_bad_config_names_verls_option(fn, config, exc, arg, words):
    with pytest.raises(exc, match=names(arg)) as info:
        fn(*_tensors(), config=config)
    assert words in str(info.value)


def test_bypass_mode_valid_values_run():
    assert math.isfinite(bypass(rollout_is="token", loss_type="reinforce")[0].item())


# --------------------------------------------------------------------------- deliberate differences
def test_difference_gspo_clamps_the_log_ratio_at_20_not_10():
    one = torch.ones(1, 1)
    cfg = _config(clip_ratio_low=0.2, clip_ratio_high=1e9)  # upper clip out of the way
    loss, _ = verl.compute_policy_loss_gspo(
        torch.zeros(1, 1), torch.full((1, 1), 15.0), one, one, config=cfg
    )
    assert loss.item() == pytest.approx(-math.exp(15.0))  # verl: −e^10


def test_difference_sapo_and_cispo_clamp_only_above():
    one = torch.ones(1, 1)
    lp = torch.full((1, 1), -30.0, dtype=torch.float64)
    loss, m = verl.compute_policy_loss_sapo(
        torch.zeros(1, 1, dtype=torch.float64), lp, one, one, config=_config()
    )
    # r = e^−30 (verl: e^−20); both gates are σ(−1)·4 to 1e-8
    assert loss.item() == pytest.approx(-4 / (1 + math.e), rel=1e-8)
    assert m["actor/ppo_kl"] == pytest.approx(30.0)  # verl: 20 (clamped)


def test_difference_geo_mean_gradient_with_per_token_advantages():
    old, new, adv, mask, _ = _batch(13)
    loss, _ = _call("geo_mean", old, new, adv, mask, _config(clip_ratio=0.4))
    ref = ref_geo_mean(old, new, adv, mask, 0.4, 0.4)
    torch.testing.assert_close(loss, ref)  # same value
    g, g_ref = torch.autograd.grad(loss, new)[0], torch.autograd.grad(ref, new)[0]
    assert not torch.allclose(g, g_ref)  # verl: −Ā·R·mean ∇l; here mean(−A_t·R·∇l_t)
