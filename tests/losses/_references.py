"""The policy-loss kinds written from their papers, one token (or row) at a time, in 40-digit
(:class:`Exact`) or same-dtype (:class:`Same`) arithmetic: the references of the kinds' tests
(``tests/losses/test_policy_kinds*.py``) and of ``benchmarks/kinds_error.py``.

Two registries: :data:`OPTIONS` names each kind's options for :func:`ref_token_losses`;
:data:`CASES` names the sequence-level and trust-region cases of :func:`definition` (a kind and
its options). :func:`run_kind`, :func:`run_case` and :func:`run_any` call ``rlops.policy_loss``
on either."""

from __future__ import annotations

import math

import mpmath
import torch
from tests._losses_util import make_inputs

import rlops

mpmath.mp.dps = 40
F64 = torch.float64


# Options of each kind used by the reference tests (clip_cov's band and kl_cov's share are
# widened so that a 6x29 batch selects several tokens).
OPTIONS = {
    "ppo": {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0},
    "reinforce": {},
    "gpg": {},
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4},
    "cispo": {"clip_low": 0.2, "clip_high": 0.5},
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    "clip_cov": {
        "clip_low": 0.2,
        "clip_high": 0.28,
        "clip_cov_ratio": 0.05,
        "clip_cov_lb": 0.1,
        "clip_cov_ub": 2.0,
    },
    "kl_cov": {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.7},
    "geo_mean": {"clip_low": 0.3, "clip_high": 0.4},
}
# the token kinds of ref_token_losses (luspo, vespo, dppo_*, dro and the sequence levels: CASES)
KINDS = tuple(OPTIONS)

# (kind, options) of the cases checked here: clip ranges wide enough that some tokens clip
CASES = {
    "gspo_dual": ("gspo", {"clip_low": 0.005, "clip_high": 0.006, "dual_clip": 1.004}),
    "cispo_seq": ("cispo", {"clip_low": 0.03, "clip_high": 0.04, "level": "sequence"}),
    "sapo_seq": ("sapo", {"tau_pos": 1.0, "tau_neg": 1.05, "level": "sequence"}),
    "luspo": ("luspo", {"clip_low": 0.02, "clip_high": 0.03}),
    "vespo": ("vespo", {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}),
    "dppo_tv": ("dppo_tv", {"clip_low": 0.05, "clip_high": 0.04, "clip_ratio_c": 1.3}),
    "dppo_kl": ("dppo_kl", {"clip_low": 0.01, "clip_high": 0.008, "clip_ratio_c": 1.3}),
    "dro": ("dro", {"dro_beta": 0.7}),
}
NEW_KINDS = ("luspo", "vespo", "dppo_tv", "dppo_kl", "dro")


# --------------------------------------------------------------------------- arithmetic
class Exact:
    """40-digit arithmetic."""

    conv = staticmethod(lambda x: mpmath.mpf(float(x)))
    exp = staticmethod(mpmath.exp)
    log = staticmethod(mpmath.log)
    zero = mpmath.mpf(0)


class Same:
    """Arithmetic in a torch dtype, one scalar at a time (a plain same-dtype loop)."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.zero = torch.zeros((), dtype=dtype)

    def conv(self, x):
        return torch.as_tensor(x).to(self.dtype)

    exp = staticmethod(torch.exp)
    log = staticmethod(torch.log)


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def as_tensor(rows, dtype=F64):
    return torch.tensor([[float(v) for v in row] for row in rows], dtype=dtype)


# --------------------------------------------------------------------------- the kinds
def ref_token_losses(kind, logp, old, adv, mask, opts, num, chosen=None):
    """``[B][T]`` per-token losses of ``kind`` from its paper's formula, one token (or row) at a
    time, 0 on mask-0 tokens. ``chosen``: clip_cov's randomly selected tokens (a set)."""
    b, t = logp.shape
    c = num.conv
    acts = [(i, j) for i in range(b) for j in range(t) if mask[i, j]]
    out = [[num.zero for _ in range(t)] for _ in range(b)]
    d = {k: c(logp[k]) - c(old[k]) for k in acts}
    a = {k: c(adv[k]) for k in acts}
    lp = {k: c(logp[k]) for k in acts}
    ratio = {k: num.exp(min(d[k], c(20.0))) for k in acts}
    low, high = opts.get("clip_low"), opts.get("clip_high")

    def ppo(k, r):
        return max(-a[k] * r, -a[k] * clip(r, 1 - c(low), 1 + c(high)))

    if kind in ("clip_cov", "kl_cov"):
        n = len(acts)
        mean_a = sum((a[k] for k in acts), num.zero) / n
        mean_lp = sum((lp[k] for k in acts), num.zero) / n
        cov = {k: (a[k] - mean_a) * (lp[k] - mean_lp) for k in acts}
    for i in range(b):
        row = [k for k in acts if k[0] == i]
        for k in row:
            if kind == "ppo":
                loss = ppo(k, ratio[k])
                if a[k] < 0:
                    loss = min(loss, -a[k] * c(opts["dual_clip"]))
            elif kind in ("reinforce", "gpg"):
                loss = -a[k] * lp[k]
            elif kind == "gspo":  # s_i = (π(y_i)/π_old(y_i))^(1/|y_i|)
                s = num.exp(min(sum((d[q] for q in row), num.zero) / len(row), c(20.0)))
                loss = ppo(k, s)
            elif kind == "cispo":
                loss = -clip(ratio[k], 1 - c(low), 1 + c(high)) * a[k] * lp[k]
            elif kind == "sapo":
                tau = c(opts["tau_pos"] if a[k] > 0 else opts["tau_neg"])
                gate = 1 / (1 + num.exp(-tau * (ratio[k] - 1))) * 4 / tau
                loss = -gate * a[k]
            elif kind == "clip_cov":
                loss = num.zero if k in chosen else ppo(k, ratio[k])
            elif kind == "kl_cov":
                quota = max(int(opts["kl_cov_ratio"] * len(acts)), 1)
                top = sorted(acts, key=lambda q: (-cov[q], q))[:quota]
                loss = -a[k] * ratio[k] + (
                    c(opts["ppo_kl_coef"]) * abs(d[k]) if k in top else num.zero
                )
            elif kind == "geo_mean":  # R_i = (Π_t clipped r_t)^(1/|y_i|)

                def clipped_log(q):
                    if a[q] > 0:
                        return min(d[q], c(high))
                    return max(d[q], -c(low)) if a[q] < 0 else num.zero

                mean = sum((clipped_log(q) for q in row), num.zero) / len(row)
                loss = -a[k] * num.exp(min(mean, c(20.0)))
            out[k[0]][k[1]] = loss
    return out


def definition(case, logp, old, adv, mask, num):
    """``[B][T]`` per-token losses of ``case`` from the papers, one row and token at a time."""
    kind, o = CASES[case]
    c = num.conv
    b, t = logp.shape
    out = [[num.zero for _ in range(t)] for _ in range(b)]
    for i in range(b):
        row = [j for j in range(t) if mask[i, j]]
        lp = {j: c(logp[i, j]) for j in row}
        lq = {j: c(old[i, j]) for j in row}
        d = {j: lp[j] - lq[j] for j in row}
        a = {j: c(adv[i, j]) for j in row}
        if not row:
            continue
        # GSPO's sequence ratio s_i = (π(y_i)/π_old(y_i))^(1/|y_i|)
        s = num.exp(min(sum((d[j] for j in row), num.zero) / len(row), c(20.0)))
        for j in row:
            if kind in ("gspo", "luspo"):
                lo, hi = c(o["clip_low"]), c(o["clip_high"])
                loss = max(-a[j] * s, -a[j] * clip(s, 1 - lo, 1 + hi))
                if kind == "gspo" and a[j] < 0:
                    loss = min(loss, -a[j] * c(o["dual_clip"]))
                if kind == "luspo":  # LUSPO: the sequence's term times its length |y_i|
                    loss = loss * len(row)
            elif kind == "cispo":  # MiniMax-M1's weight, from the sequence ratio
                w = clip(s, 1 - c(o["clip_low"]), 1 + c(o["clip_high"]))
                loss = -w * a[j] * lp[j]
            elif kind == "sapo":  # SAPO's gate f(x) = σ(τ(x − 1))·4/τ of the sequence ratio
                tau = c(o["tau_pos"] if a[j] > 0 else o["tau_neg"])
                loss = -a[j] * 4 / tau / (1 + num.exp(-tau * (s - 1)))
            elif kind == "vespo":  # φ(W) = W^k·e^(λ(1 − W)), W = π(y_i)/π_old(y_i)
                log_w = sum((clip(d[q], c(-20.0), c(20.0)) for q in row), num.zero)
                log_w = clip(log_w, c(math.log(1e-8)), c(20.0))
                w = num.exp(log_w)
                k, lam = (
                    (o["k_pos"], o["lambda_pos"]) if a[j] >= 0 else (o["k_neg"], o["lambda_neg"])
                )
                phi = w ** c(k) * num.exp(c(lam) * (1 - w))
                loss = -phi * a[j] * lp[j]
            elif kind in ("dppo_tv", "dppo_kl"):  # DPPO: a binary trust region on π vs π_old
                p, q = num.exp(lp[j]), num.exp(lq[j])
                if kind == "dppo_tv" and a[j] > 0:
                    keep = p - q <= c(o["clip_high"])
                elif kind == "dppo_tv":
                    keep = p - q >= -c(o["clip_low"])
                else:
                    kl = q * num.log(q / p) + (1 - q) * num.log((1 - q) / (1 - p))
                    keep = (
                        (kl <= c(o["clip_high"])) | (p <= q)
                        if a[j] > 0
                        else (kl <= c(o["clip_low"])) | (p >= q)
                    )
                r = num.exp(min(d[j], c(20.0)))
                loss = -a[j] * min(r, c(o["clip_ratio_c"])) * lp[j] if keep else num.zero
            elif kind == "dro":  # DRO: −(A·log π − β/2·(log π − log π_old)²)
                loss = -(a[j] * lp[j] - c(o["dro_beta"]) / 2 * d[j] ** 2)
            out[i][j] = loss
    return out


def clip_cov_candidates(logp, old, adv, mask, opts):
    """Tokens that clip_cov may zero: not clipped by PPO, covariance strictly inside the band."""
    keep = mask.bool()
    lp, o, a, m = (torch.where(keep, x.double(), 0) for x in (logp, old, adv, mask))
    r = torch.exp((lp - o).clamp_max(20))
    hit = -a * r.clamp(1 - opts["clip_low"], 1 + opts["clip_high"]) > -a * r
    n = keep.sum()
    cov = (a - (a * m).sum() / n) * (lp - (lp * m).sum() / n)
    cand = keep & ~hit & (cov > opts["clip_cov_lb"]) & (cov < opts["clip_cov_ub"])
    return {tuple(k) for k in cand.nonzero().tolist()}


# --------------------------------------------------------------------------- the calls
def run_kind(kind, logp, old, adv, mask, agg="token-mean", **kw):
    """``rlops.policy_loss`` of a token kind with its :data:`OPTIONS` (clip_cov: a seeded
    generator)."""
    opts = dict(OPTIONS[kind])
    if kind == "clip_cov":
        opts["generator"] = torch.Generator().manual_seed(11)
    return rlops.policy_loss(logp, old, adv, mask, kind=kind, agg=agg, **opts, **kw)


def run_case(case, logp, old, adv, mask, agg=None, **kw):
    """``rlops.policy_loss`` of a :data:`CASES` entry."""
    kind, opts = CASES[case]
    return rlops.policy_loss(logp, old, adv, mask, kind=kind, agg=agg, **opts, **kw)


def run_any(name, logp, old, adv, mask, agg, **kw):
    """:func:`run_kind` or :func:`run_case`, by name (the two registries share none)."""
    run = run_kind if name in OPTIONS else run_case
    return run(name, logp, old, adv, mask, agg=agg, **kw)


def kind_and_options(name):
    """``(kind, options)`` of a name of either registry, without a generator."""
    if name in OPTIONS:
        return name, {k: v for k, v in OPTIONS[name].items() if k != "generator"}
    return CASES[name]


def inputs(case, dtype, seed, **kw):
    """:func:`make_inputs`; DPPO's log-probs kept below 0 (probabilities, π < 1)."""
    logp, old, adv, mask = make_inputs(dtype, seed, spread=0.3 if "dppo" in case else 0.05, **kw)
    if "dppo" in case:
        logp, old = logp.clamp_max(-0.01), old.clamp_max(-0.01)
    if case == "gspo_dual":  # rows whose sequence ratio passes the dual clip
        logp = logp + 0.02
    return logp, old, adv, mask


def per_row_adv(adv, mask):
    """One advantage per row (its first entry), as GSPO, LUSPO and VESPO use them."""
    return adv[:, :1].expand_as(adv).contiguous()


def peer_batch(seed, b=4, t=11, spread=0.05):
    """float64 inputs with every row non-empty (TRL and Liger average over all rows) and one
    advantage per row (their ``advantages`` are ``(B, 1)``)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3 - 0.05
    logp = old + spread * torch.randn(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, 1, generator=g, dtype=F64)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[:, 0] = True
    return logp, old, adv, mask.to(F64)
