"""verl's rollout correction by its names (``rollout_corr_helper``) against plain restatements of
verl's documented behaviour: TIS truncation, IcePop zeroing, sequence products, batch
normalisation, the rejection options and their string thresholds (loops, float64); the IS / RS
diagnostics (``compute_is_metrics``, ``compute_rs_metrics``) against verl's formulas; bad input
naming verl's arguments."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from tests._bad_input import names

from rlops.compat import verl

B, T = 6, 8


def _batch(seed=0, scale=0.6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    rollout = old - scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    n = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < n[:, None]).long()
    mask[2, 1:3] = 0
    return old, rollout, mask


def _tokens(mask):
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]


def ref_weights(log_ratio, mask, level, upper, lower):
    """verl: token ρ_t or sequence Π ρ_t (exp of the masked sum); TIS min(ρ, upper); IcePop ρ
    inside [lower, upper], else 0; 0 on padding."""
    w = torch.zeros_like(log_ratio)
    for i in range(log_ratio.shape[0]):
        s = sum(float(log_ratio[i, t]) for t in range(log_ratio.shape[1]) if mask[i, t])
        for t in range(log_ratio.shape[1]):
            if not mask[i, t]:
                continue
            rho = math.exp(float(log_ratio[i, t]) if level == "token" else s)
            if lower is None:
                w[i, t] = min(rho, upper)
            else:
                w[i, t] = rho if lower <= rho <= upper else 0.0
    return w


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(
    "spec,upper,lower", [(2.0, 2.0, None), ("1.5", 1.5, None), ("0.5_2.0", 2.0, 0.5)]
)
def test_weights_match_verls_tis_and_icepop(level, spec, upper, lower):
    old, rollout, mask = _batch(1, scale=0.4 if level == "token" else 0.3)
    lr = old - rollout
    w, m = verl.compute_rollout_correction_weights(lr, mask, level, spec)
    ref = ref_weights(lr, mask, level, upper, lower)
    torch.testing.assert_close(w, ref)
    toks = _tokens(mask)
    assert m["rollout_is_mean"] == pytest.approx(sum(float(ref[p]) for p in toks) / len(toks))
    if level == "token":  # of the applied weights
        assert m["rollout_is_max"] == pytest.approx(max(float(ref[p]) for p in toks))
        assert m["rollout_is_min"] == pytest.approx(min(float(ref[p]) for p in toks))
    else:  # verl: of the rows' raw ratios, every row
        sums = [sum(float(lr[i, t]) for t in range(T) if mask[i, t]) for i in range(B)]
        assert m["rollout_is_max"] == pytest.approx(math.exp(max(sums)))
        assert m["rollout_is_min"] == pytest.approx(math.exp(min(sums)))
        floor = 1 / upper if lower is None else lower
        assert m["rollout_is_ratio_fraction_high"] == pytest.approx(
            sum(s > math.log(upper) for s in sums) / B
        )
        assert m["rollout_is_ratio_fraction_low"] == pytest.approx(
            sum(s < math.log(floor) for s in sums) / B
        )
    mean = sum(float(ref[p]) for p in toks) / len(toks)
    sq = sum(float(ref[p]) ** 2 for p in toks) / len(toks)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(mean**2 / sq)
    if level == "token":
        high = sum(math.exp(float(lr[p])) > upper for p in toks) / len(toks)
        assert m["rollout_is_ratio_fraction_high"] == pytest.approx(high)
        floor = 1 / upper if lower is None else lower
        low = sum(math.exp(float(lr[p])) < floor for p in toks) / len(toks)
        assert m["rollout_is_ratio_fraction_low"] == pytest.approx(low)
    if lower is not None:
        out = [p for p in toks if ref[p] == 0]
        assert m["rollout_is_oob_ratio"] == pytest.approx(len(out) / len(toks))
        assert 0 < len(out) < len(toks)
    else:
        assert "rollout_is_oob_ratio" not in m
    assert not w.requires_grad


def test_batch_normalize_as_verl():
    old, rollout, mask = _batch(2, scale=0.2)
    lr = old - rollout
    w, m = verl.compute_rollout_correction_weights(lr, mask, "token", 2.0, True)
    ref = ref_weights(lr, mask, "token", 2.0, None)
    toks = _tokens(mask)
    mean = sum(float(ref[p]) for p in toks) / len(toks)
    torch.testing.assert_close(w, ref / mean)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(mean)
    assert m["rollout_is_mean"] == pytest.approx(mean)  # before normalisation
    # sequence level: the mean of one weight per row (rows of every length count once)
    w, m = verl.compute_rollout_correction_weights(lr, mask, "sequence", 5.0, True)
    ref = ref_weights(lr, mask, "sequence", 5.0, None)
    rows = [float(ref[i][mask[i].bool()][0]) for i in range(B) if mask[i].any()]
    factor = sum(rows) / len(rows)
    torch.testing.assert_close(w, ref / factor)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(factor)


def test_hand_computed_weights():
    lr = torch.tensor([[math.log(3.0), math.log(0.5), 0.0]])
    w, m = verl.compute_rollout_correction_weights(lr, torch.tensor([[1, 1, 0]]), "token", 2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 0.0]]))
    assert m["rollout_is_mean"] == pytest.approx(1.25)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(0.5)
    # sequence: 3·0.5 = 1.5 -> inside [0.5, 2]; IcePop keeps it
    w, _ = verl.compute_rollout_correction_weights(
        lr, torch.tensor([[1, 1, 0]]), "sequence", "0.5_2"
    )
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 0.0]]))


def ref_reject(lr, mask, criteria):
    """verl: k1 = −d in [log lower, log upper], k2 = d²/2 <= upper, k3 = e^d − 1 − d <= upper;
    token options per token, seq_sum / seq_mean / seq_max over the row's response tokens."""
    keep = mask.clone().double()
    for i in range(lr.shape[0]):
        idx = [t for t in range(lr.shape[1]) if mask[i, t]]
        for option, bound in criteria.items():
            k = option[-2:]

            def stat(t, k=k, i=i):
                d = float(lr[i, t])
                return {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - 1 - d}[k]

            def ok(x, k=k, bound=bound):
                if k == "k1":
                    lo, hi = bound
                    return math.log(lo) <= x <= math.log(hi)
                return x <= bound

            if option.startswith("token"):
                for t in idx:
                    if not ok(stat(t)):
                        keep[i, t] = 0
            elif idx:
                vals = [stat(t) for t in idx]
                agg = {
                    "seq_sum": sum(vals),
                    "seq_mean": sum(vals) / len(vals),
                    "seq_max": max(vals),
                }[option[:-3]]
                if not ok(agg):
                    keep[i] = 0
    return keep * mask


@pytest.mark.parametrize(
    "rollout_rs,threshold,criteria",
    [
        ("token_k1", "0.8_1.25", {"token_k1": (0.8, 1.25)}),
        ("token_k1", 1.25, {"token_k1": (0.8, 1.25)}),
        ("token_k2,seq_mean_k3", "0.05,0.02", {"token_k2": 0.05, "seq_mean_k3": 0.02}),
        ("seq_sum_k1, seq_max_k2", "0.5_2.0,0.1", {"seq_sum_k1": (0.5, 2.0), "seq_max_k2": 0.1}),
        (
            "seq_sum_k3,token_k3,seq_mean_k1",
            "0.3",
            {"seq_sum_k3": 0.3, "token_k3": 0.3, "seq_mean_k1": (1 / 0.3, 0.3)},
        ),
    ],
)
def test_rejection_matches_verls_options(rollout_rs, threshold, criteria):
    if rollout_rs.endswith("seq_mean_k1"):  # lower = 1/upper > upper: verl rejects the spec
        with pytest.raises(ValueError, match="rollout_rs_threshold"):
            verl.compute_rollout_rejection_mask(
                torch.zeros(2, 2), torch.ones(2, 2), rollout_rs, threshold
            )
        return
    old, rollout, mask = _batch(3, scale=0.3)
    lr = old - rollout
    out, m = verl.compute_rollout_rejection_mask(lr, mask, rollout_rs, threshold)
    ref = ref_reject(lr, mask, criteria)
    assert out.dtype == mask.dtype
    torch.testing.assert_close(out.double(), ref)
    toks = _tokens(mask)
    dropped = sum(1 for p in toks if ref[p] == 0)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(dropped / len(toks))
    for option in criteria:
        assert f"rollout_rs_{option}_masked_fraction" in m


def test_rejection_hand_computed():
    lr = torch.tensor([[0.0, math.log(2.0)], [0.1, 0.0]])
    # token_k1 with ratio bounds [0.8, 1.25]: −log 2 < log 0.8 -> token (0, 1) rejected
    out, m = verl.compute_rollout_rejection_mask(lr, torch.ones(2, 2), "token_k1", 1.25)
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    assert m["rollout_rs_masked_fraction"] == 0.25
    assert m["rollout_rs_seq_masked_fraction"] == 0.5
    # seq_sum_k2: row 0: (log 2)²/2 = 0.240 > 0.1 -> whole row; row 1: 0.005 kept
    out, m = verl.compute_rollout_rejection_mask(lr, torch.ones(2, 2), "seq_sum_k2", 0.1)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert m["rollout_rs_seq_sum_k2_max"] == pytest.approx(math.log(2) ** 2 / 2)


def test_combined_entry_point():
    old, rollout, mask = _batch(4, scale=0.3)
    proto, out, m = verl.compute_rollout_correction_and_rejection_mask(
        old,
        rollout,
        mask,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="token_k2",
        rollout_rs_threshold=0.05,
    )
    lr = old - rollout
    torch.testing.assert_close(
        proto.batch["rollout_is_weights"], ref_weights(lr, mask, "token", 2.0, None)
    )
    torch.testing.assert_close(out.double(), ref_reject(lr, mask, {"token_k2": 0.05}))
    assert all(k.startswith("rollout_corr/") for k in m)
    toks = _tokens(mask)
    kl = sum(float(rollout[p] - old[p]) for p in toks) / len(toks)
    assert m["rollout_corr/kl"] == pytest.approx(kl)
    k3 = sum(math.exp(float(lr[p])) - float(lr[p]) - 1 for p in toks) / len(toks)
    assert m["rollout_corr/k3_kl"] == pytest.approx(k3)
    chi2 = sum(math.exp(2 * float(lr[p])) for p in toks) / len(toks) - 1
    assert m["rollout_corr/chi2_token"] == pytest.approx(chi2)
    # everything off: no weights, the mask unchanged (a copy), mismatch metrics only
    proto, out, m = verl.compute_rollout_correction_and_rejection_mask(old, rollout, mask)
    assert proto is None and torch.equal(out, mask) and out is not mask
    assert set(m) == {
        f"rollout_corr/{k}"
        for k in (
            "chi2_seq",
            "chi2_token",
            "k3_kl",
            "kl",
            "log_ppl_abs_diff",
            "log_ppl_diff",
            "log_ppl_diff_max",
            "log_ppl_diff_min",
            "ppl_ratio",
            "rollout_log_ppl",
            "rollout_ppl",
            "training_log_ppl",
            "training_ppl",
        )
    }


def test_signatures_are_verls():
    def names(fn):
        return list(inspect.signature(fn).parameters)

    assert names(verl.compute_rollout_correction_weights) == [
        "log_ratio",
        "response_mask",
        "rollout_is",
        "rollout_is_threshold",
        "rollout_is_batch_normalize",
    ]
    assert names(verl.compute_rollout_rejection_mask) == [
        "log_ratio",
        "response_mask",
        "rollout_rs",
        "rollout_rs_threshold",
    ]
    assert names(verl.compute_rollout_correction_and_rejection_mask) == [
        "old_log_prob",
        "rollout_log_prob",
        "response_mask",
        "rollout_is",
        "rollout_is_threshold",
        "rollout_is_batch_normalize",
        "rollout_rs",
        "rollout_rs_threshold",
    ]
    assert names(verl.compute_offpolicy_metrics) == [
        "old_log_prob",
        "rollout_log_prob",
        "response_mask",
    ]


_L = torch.zeros(2, 3)
_M = torch.ones(2, 3)
BAD = [
    (
        lambda: verl.compute_rollout_correction_weights(_L, _M, "geometric"),
        ValueError,
        "rollout_is",
    ),
    (
        lambda: verl.compute_rollout_correction_weights(_L, _M, "token", -1.0),
        ValueError,
        "rollout_is_threshold",
    ),
    (
        lambda: verl.compute_rollout_correction_weights(_L, _M, "token", "2_1"),
        ValueError,
        "rollout_is_threshold",
    ),
    (
        lambda: verl.compute_rollout_correction_weights(_L, _M, "token", "x"),
        ValueError,
        "rollout_is_threshold",
    ),
    (
        lambda: verl.compute_rollout_correction_weights(_L, _M, "token", True),
        TypeError,
        "rollout_is_threshold",
    ),
    (
        lambda: verl.compute_rollout_correction_weights(_L, _M, "token", 2.0, "yes"),
        TypeError,
        "rollout_is_batch_normalize",
    ),
    (
        lambda: verl.compute_rollout_correction_weights(_L, torch.ones(2, 4)),
        ValueError,
        "response_mask",
    ),
    (
        lambda: verl.compute_rollout_correction_weights(_L, torch.zeros(2, 3)),
        ValueError,
        "response_mask",
    ),
    (
        lambda: verl.compute_rollout_correction_weights(torch.zeros(3), torch.ones(3)),
        ValueError,
        "log_ratio",
    ),
    (
        lambda: verl.compute_rollout_rejection_mask(_L, _M, "token_k4", 1.0),
        ValueError,
        "rollout_rs",
    ),
    (
        lambda: verl.compute_rollout_rejection_mask(_L, _M, "token_k1", None),
        ValueError,
        "rollout_rs_threshold",
    ),
    (
        lambda: verl.compute_rollout_rejection_mask(_L, _M, "token_k2", "0.1_0.2"),
        ValueError,
        "rollout_rs_threshold",
    ),
    (
        lambda: verl.compute_rollout_rejection_mask(_L, _M, "token_k2,seq_max_k3", "1,2,3"),
        ValueError,
        "rollout_rs_threshold",
    ),
    (lambda: verl.compute_rollout_rejection_mask(_L, _M, 3, 1.0), ValueError, "rollout_rs"),
    (
        lambda: verl.compute_rollout_correction_and_rejection_mask(_L, torch.zeros(2, 4), _M),
        ValueError,
        "rollout_log_prob",
    ),
    (
        lambda: verl.compute_rollout_correction_and_rejection_mask(
            _L, _L, _M, rollout_rs="token_k2"
        ),
        ValueError,
        "rollout_rs_threshold",
    ),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_input_names_verls_argument(i):
    call, err, word = BAD[i]
    with pytest.raises(err, match=word):
        call()


# --------------------------------------------------------------------------- deliberate differences
def test_metrics_over_rows_and_the_differences():
    lr = torch.tensor(
        [[math.log(0.25), 0.0, 0.0], [math.log(4.0), 0.0, 0.0], [0.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # TIS: verl's fraction_low counts ratios below 1/threshold (0.25 < 0.5): 1 of 4 tokens
    _, m = verl.compute_rollout_correction_weights(lr, mask, "token", 2.0)
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 4)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 4)
    # sequence level, as verl: over rows, the empty row too (ratios 0.25, 4 and 1)
    _, m = verl.compute_rollout_correction_weights(lr, mask, "sequence", 2.0)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)
    assert m["rollout_is_max"] == pytest.approx(4.0) and m["rollout_is_min"] == pytest.approx(0.25)
    # rejection: seq_masked_fraction over all rows, as verl (1 of 3)
    lr[1, 0] = math.log(1.5)
    _, m = verl.compute_rollout_rejection_mask(lr, mask, "seq_sum_k2", 0.5)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 3)
    # a sequence option's mean is over rows (verl: over tokens, weighted by row length)
    stat = [math.log(0.25) ** 2 / 2, math.log(1.5) ** 2 / 2]
    assert m["rollout_rs_seq_sum_k2_mean"] == pytest.approx(sum(stat) / 2)


def test_difference_log_ratio_not_clamped_before_the_bounds():
    lr = torch.tensor([[25.0, 0.0]], dtype=torch.float64)
    # IcePop with an upper bound above e^20: verl compares e^20 (clamped) and keeps the token
    # only if e^20 <= upper; here the log-weight 25 > log(e^22) is compared unclamped
    w, _ = verl.compute_rollout_correction_weights(
        lr, torch.ones(1, 2), "token", f"0.5_{math.exp(22.0)}"
    )
    assert w[0, 0] == 0.0  # verl: e^20


def test_offpolicy_perplexities_as_verl():
    old, rollout, mask = _batch(5, scale=0.3)
    m = verl.compute_offpolicy_metrics(old, rollout, mask)
    rows = range(old.shape[0])

    def row_mean(x, i):
        return sum(float(x[i, t]) for t in range(T) if mask[i, t]) / int(mask[i].sum())

    train = [-row_mean(old, i) for i in rows]
    roll = [-row_mean(rollout, i) for i in rows]
    gap = [a - b for a, b in zip(train, roll)]  # m̄_rollout − m̄_train
    assert m["training_ppl"] == pytest.approx(sum(math.exp(x) for x in train) / B)
    assert m["training_log_ppl"] == pytest.approx(sum(train) / B)
    assert m["rollout_ppl"] == pytest.approx(sum(math.exp(x) for x in roll) / B)
    assert m["log_ppl_diff"] == pytest.approx(sum(gap) / B)
    assert m["log_ppl_abs_diff"] == pytest.approx(sum(abs(x) for x in gap) / B)
    assert m["log_ppl_diff_max"] == pytest.approx(max(gap))
    assert m["ppl_ratio"] == pytest.approx(sum(math.exp(x) for x in gap) / B)
    only_train = verl.compute_offpolicy_metrics(old, None, mask)
    assert set(only_train) == {"training_ppl", "training_log_ppl"}


def test_is_std_hand_computed():
    # IcePop [0.5, 5]: ratios 0.4, 0.8, 6 -> weights 0, 0.8, 0: population std of (0, 0.8, 0)
    lr = torch.log(torch.tensor([[0.4, 0.8, 6.0]], dtype=torch.float64))
    _, m = verl.compute_rollout_correction_weights(lr, torch.ones(1, 3), "token", "0.5_5.0")
    assert m["rollout_is_std"] == pytest.approx(math.sqrt(0.64 / 3 - (0.8 / 3) ** 2))
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sequence_ratio_past_exps_range(dtype):
    # every row's log-ratio sums to 800 > log(float64 max) ≈ 709.8. verl: the weight is
    # e^{clamp(800, ±20)} truncated at 2; rollout_is_max = e^{min(800, 20)};
    # rollout_is_min = torch.exp(800) in the log-ratio's dtype = inf (no cap); all rows high
    lr = torch.full((2, 4), 200.0, dtype=dtype)
    w, m = verl.compute_rollout_correction_weights(lr, torch.ones(2, 4), "sequence", 2.0)
    torch.testing.assert_close(w, torch.full((2, 4), 2.0, dtype=dtype))
    assert m["rollout_is_max"] == pytest.approx(math.exp(20.0), rel=1e-6)
    assert m["rollout_is_min"] == math.inf
    assert m["rollout_is_ratio_fraction_high"] == 1.0
    assert m["rollout_is_mean"] == pytest.approx(2.0)
    # token level (each ρ_t = e^20 after verl's clamp, truncated at 2)
    w, m = verl.compute_rollout_correction_weights(lr, torch.ones(2, 4), "token", 2.0)
    torch.testing.assert_close(w, torch.full((2, 4), 2.0, dtype=dtype))
    assert m["rollout_is_min"] == m["rollout_is_max"] == 2.0


def test_sequence_ratio_min_in_the_log_ratios_dtype():
    # a row sum of 100: verl's torch.exp(100) is inf in float32 (> 88.7), e^100 in float64
    lr = torch.tensor([[60.0, 40.0]])
    _, m = verl.compute_rollout_correction_weights(lr, torch.ones(1, 2), "sequence", 2.0)
    assert m["rollout_is_min"] == math.inf
    _, m = verl.compute_rollout_correction_weights(lr.double(), torch.ones(1, 2), "sequence", 2.0)
    assert m["rollout_is_min"] == pytest.approx(math.exp(100.0))


# --------------------------------------------------------------- diagnostics: verl's formulas
def vmean(x, m, axis=None):
    """verl_F.masked_mean."""
    m = m.double()
    return (torch.where(m.bool(), x, 0) * m).sum(axis) / (m.sum(axis) + 1e-8)


def verl_is_metrics(w, raw, lr, m, level, up, lo=None):
    lo = 1 / up if lo is None else lo
    out = {}
    if level == "sequence":
        out["rollout_is_max"] = math.exp(min(float(lr.max()), 20.0))
        out["rollout_is_min"] = math.exp(float(lr.min()))
        out["rollout_is_mean"] = float(vmean(w, m))
        out["rollout_is_ratio_fraction_high"] = float((lr > math.log(up)).double().mean())
        out["rollout_is_ratio_fraction_low"] = float((lr < math.log(lo)).double().mean())
    else:
        out["rollout_is_mean"] = float(vmean(w, m))
        out["rollout_is_ratio_fraction_high"] = float(vmean((raw > up).double(), m))
        out["rollout_is_ratio_fraction_low"] = float(vmean((raw < lo).double(), m))
        out["rollout_is_max"] = float(w[m].max())
        out["rollout_is_min"] = float(w[m].min())
    c = w.clamp(0, up)
    if m.sum() > 1:
        out["rollout_is_std"] = math.sqrt(max(float(vmean(c**2, m) - vmean(c, m) ** 2), 0.0))
    else:
        out["rollout_is_std"] = 0.0
    out["rollout_is_eff_sample_size"] = 1 / float(vmean((c / (vmean(c, m) + 1e-8)) ** 2, m))
    s = vmean(w, m, -1)
    out["rollout_is_seq_mean"] = float(s.mean())
    out["rollout_is_seq_std"] = float(s.std()) if s.numel() > 1 else 0.0
    out["rollout_is_seq_max"] = float(s.max())
    out["rollout_is_seq_min"] = float(s.min())
    out["rollout_is_seq_max_deviation"] = float((s - 1).abs().max())
    rs = vmean(raw, m, -1)
    out["rollout_is_seq_fraction_high"] = float((rs > up).double().mean())
    out["rollout_is_seq_fraction_low"] = float((rs < lo).double().mean())
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("lower", [None, 0.7])
def test_compute_is_metrics_matches_verl(level, lower):
    g = torch.Generator().manual_seed(6)
    mask = torch.rand(5, 8, generator=g) < 0.7
    raw = torch.exp(torch.randn(5, 8, generator=g, dtype=torch.float64) * 0.6)
    w = raw.clamp(max=1.5)
    lr = torch.randn(5, generator=g, dtype=torch.float64) if level == "sequence" else raw.log()
    got = verl.compute_is_metrics(w, raw, lr, mask, level, 1.5, lower)
    ref = verl_is_metrics(w, raw, lr, mask, level, 1.5, lower)
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=1e-6, abs=1e-9), k
    with pytest.raises(ValueError, match="response_mask"):
        verl.compute_is_metrics(w, raw, lr, torch.zeros(5, 8), level, 1.5)


def verl_rs_metrics(name, x, m, valid_rows, level, per_seq, up, lo, apply_lo):
    p = f"rollout_rs_{name}"
    seq = per_seq if per_seq is not None else vmean(x, m, -1)
    v = seq[valid_rows]
    out = {f"{p}_mean": float(vmean(x, m))}
    if level == "sequence" and v.numel():
        out[f"{p}_max"], out[f"{p}_min"] = float(v.max()), float(v.min())
        out[f"{p}_fraction_high"] = float((v > up).double().mean())
        out[f"{p}_fraction_low"] = float((v < lo).double().mean()) if apply_lo else 0.0
    else:
        out[f"{p}_max"], out[f"{p}_min"] = float(x[m].max()), float(x[m].min())
        out[f"{p}_fraction_high"] = float(vmean((x > up).double(), m))
        out[f"{p}_fraction_low"] = float(vmean((x < lo).double(), m)) if apply_lo else 0.0
    c = x.clamp(lo if apply_lo else 0.0, up)
    out[f"{p}_std"] = math.sqrt(max(float(vmean(c**2, m) - vmean(c, m) ** 2), 0.0))
    out[f"{p}_seq_mean"] = float(v.mean())
    out[f"{p}_seq_std"] = float(v.std())
    out[f"{p}_seq_max"], out[f"{p}_seq_min"] = float(v.max()), float(v.min())
    out[f"{p}_seq_max_deviation"] = float(v.abs().max())
    out[f"{p}_seq_fraction_high"] = float((v > up).double().mean())
    if apply_lo:
        out[f"{p}_seq_fraction_low"] = float((v < lo).double().mean())
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("apply_lo", [False, True])
@pytest.mark.parametrize("per_seq", [False, True])
def test_compute_rs_metrics_matches_verl(level, apply_lo, per_seq):
    g = torch.Generator().manual_seed(8)
    mask = torch.rand(6, 8, generator=g) < 0.7
    mask[2] = False
    x = torch.rand(6, 8, generator=g, dtype=torch.float64) * 2 - 0.5
    valid = mask.any(-1)
    seq = torch.randn(6, 1, generator=g, dtype=torch.float64) if per_seq else None
    got = verl.compute_rs_metrics(
        "opt",
        x,
        mask,
        valid,
        level=level,
        per_sequence_values=seq,
        rollout_rs_threshold=1.0,
        rollout_rs_threshold_lower=0.1,
        apply_lower_threshold=apply_lo,
    )
    ref = verl_rs_metrics(
        "opt", x, mask, valid, level, None if seq is None else seq[:, 0], 1.0, 0.1, apply_lo
    )
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=1e-6, abs=1e-9), k


# --------------------------------------------------------------------------- diagnostics: bad input
BB, TT = 3, 4  # (the shapes the messages below name)


def _log_probs():
    g = torch.Generator().manual_seed(0)
    logp, old = (-torch.rand(BB, TT, generator=g) - 0.1 for _ in range(2))  # logp drawn first
    return old, logp, torch.ones(BB, TT)


def is_metrics(**kw):
    old, logp, mask = _log_probs()
    w = (logp - old).exp()
    args = {
        "rollout_is_weights": w.clamp(max=2.0),
        "raw_rollout_is_weights": w,
        "log_ratio_for_metrics": logp - old,
        "response_mask": mask,
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        **kw,
    }
    return verl.compute_is_metrics(**args)


@pytest.mark.parametrize(
    ("kw", "exc", "arg", "words"),
    [
        ({"rollout_is": "tokens"}, ValueError, "rollout_is", "'token', 'sequence'"),
        ({"rollout_is": None}, ValueError, "rollout_is", "'token', 'sequence'"),
        ({"rollout_is_threshold": math.nan}, ValueError, "rollout_is_threshold", "> 0"),
        ({"rollout_is_threshold": "2"}, TypeError, "rollout_is_threshold", "real number"),
        ({"rollout_is_threshold_lower": -0.5}, ValueError, "rollout_is_threshold_lower", "> 0"),
        (
            {"rollout_is_weights": torch.ones(BB, TT, dtype=torch.long)},
            TypeError,
            "rollout_is_weights",
            "floating-point",
        ),
        (
            {"raw_rollout_is_weights": torch.ones(BB, TT, dtype=torch.long)},
            TypeError,
            "raw_rollout_is_weights",
            "floating-point",
        ),
        (
            {"raw_rollout_is_weights": torch.ones(BB, TT - 1)},
            ValueError,
            "raw_rollout_is_weights",
            "[3, 4]",
        ),
        (
            {"log_ratio_for_metrics": torch.zeros(BB, TT, dtype=torch.long)},
            TypeError,
            "log_ratio_for_metrics",
            "floating-point",
        ),
        ({"response_mask": torch.full((BB, TT), 0.5)}, ValueError, "response_mask", "only 0 and 1"),
    ],
)
def test_compute_is_metrics_bad_argument_names_it(kw, exc, arg, words):
    with pytest.raises(exc, match=names(arg)) as info:
        is_metrics(**kw)
    assert words in str(info.value)


def rs_metrics(**kw):
    old, logp, mask = _log_probs()
    args = {
        "option_name": "token_k1",
        "rs_statistic": logp - old,
        "response_mask": mask,
        "seq_valid_mask": torch.ones(BB, dtype=torch.bool),
        "level": "token",
        "per_sequence_values": None,
        "rollout_rs_threshold": 1.0,
        "rollout_rs_threshold_lower": 0.1,
        "apply_lower_threshold": True,
        **kw,
    }
    option_name = args.pop("option_name")
    rs, mask, valid = (
        args.pop("rs_statistic"),
        args.pop("response_mask"),
        args.pop("seq_valid_mask"),
    )
    return verl.compute_rs_metrics(option_name, rs, mask, valid, **args)


@pytest.mark.parametrize(
    ("kw", "exc", "arg", "words"),
    [
        ({"option_name": 3}, TypeError, "option_name", "str"),
        ({"level": "row"}, ValueError, "level", "'token', 'sequence'"),
        ({"rollout_rs_threshold": math.nan}, ValueError, "rollout_rs_threshold", "a number"),
        ({"rollout_rs_threshold": "x"}, TypeError, "rollout_rs_threshold", "real number"),
        (
            {"rollout_rs_threshold_lower": math.nan},
            ValueError,
            "rollout_rs_threshold_lower",
            "a number",
        ),
        (
            {"rollout_rs_threshold_lower": None},
            TypeError,
            "rollout_rs_threshold_lower",
            "real number",
        ),
        ({"apply_lower_threshold": "no"}, TypeError, "apply_lower_threshold", "bool"),
        ({"apply_lower_threshold": 1}, TypeError, "apply_lower_threshold", "bool"),
        (
            {"seq_valid_mask": torch.ones(BB + 1, dtype=torch.bool)},
            ValueError,
            "seq_valid_mask",
            "[3]",
        ),
        ({"seq_valid_mask": torch.full((BB,), 0.5)}, ValueError, "seq_valid_mask", "only 0 and 1"),
        ({"per_sequence_values": torch.ones(BB, 2)}, ValueError, "per_sequence_values", "[bs]"),
        (
            {"per_sequence_values": torch.ones(BB, dtype=torch.long)},
            TypeError,
            "per_sequence_values",
            "floating-point",
        ),
        (
            {"rs_statistic": torch.ones(BB, TT, dtype=torch.long)},
            TypeError,
            "rs_statistic",
            "floating-point",
        ),
    ],
)
def test_compute_rs_metrics_bad_argument_names_it(kw, exc, arg, words):
    with pytest.raises(exc, match=names(arg)) as info:
        rs_metrics(**kw)
    assert words in str(info.value)


def test_diagnostics_valid_values_run():
    assert math.isfinite(
        is_metrics(rollout_is="sequence", log_ratio_for_metrics=torch.zeros(BB))["rollout_is_mean"]
    )
    m = rs_metrics(level="sequence", per_sequence_values=torch.zeros(BB, 1))
    assert math.isfinite(m["rollout_rs_token_k1_mean"])
