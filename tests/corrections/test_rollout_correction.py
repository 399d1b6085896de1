"""Rollout-training mismatch correction against loop references written from the formulas.

The references below walk the batch one row and one token at a time in numpy scalars of a
chosen precision: float64 is the oracle; float32 gives the budget (our float32 result may be
at most twice as far from the oracle as the float32 loop, plus a few ulps —
``tests/tolerances.py``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tests._bad_input import names
from tests._distributed import count_collectives, run_distributed
from tests._losses_util import BAD_LAYOUT, BAD_LAYOUT_IDS, LAYOUT_IDS
from tests.tolerances import assert_within_reference

from rlops.corrections.rollout import (
    IS_LEVELS,
    IS_MODES,
    RS_OPTIONS,
    rollout_importance_weights,
    rollout_mismatch_metrics,
    rollout_rejection_mask,
)

F32, F64 = torch.float32, torch.float64
# Log-weights saturate at 20 before every exp (e^20 ≈ 4.9e8: finite in float32 and bfloat16),
# as the module's docstring states; written here from that statement, not read from the code.
CAP = 20.0


# --------------------------------------------------------------------------- loop references
def _rows(old, rollout, mask, dt):
    """Per row: the action tokens' log-ratios ``d`` (in ``dt``) and their columns."""
    o, r = old.double().numpy().astype(dt), rollout.double().numpy().astype(dt)
    m = mask.bool().numpy()
    return [
        (
            [o[b, t] - r[b, t] for t in range(m.shape[1]) if m[b, t]],
            [t for t in range(m.shape[1]) if m[b, t]],
        )
        for b in range(m.shape[0])
    ]


def _serial_sum(xs, dt):
    s = dt(0)
    for x in xs:
        s = dt(s + x)
    return s


def _k3(d, dt):
    dc = min(d, dt(CAP))
    return max(dt(np.expm1(dc) - dc), dt(0))


def loop_mismatch(old, rollout, mask, dt=np.float64):
    rows = _rows(old, rollout, mask, dt)
    ds = [d for row, _ in rows for d in row]
    full = [(row, _serial_sum(row, dt)) for row, _ in rows if row]
    n, r = max(len(ds), 1), max(len(full), 1)
    return {
        "chi2_seq": _serial_sum([np.expm1(dt(2) * min(s, dt(CAP))) for _, s in full], dt) / r,
        "chi2_token": _serial_sum([np.expm1(dt(2) * min(d, dt(CAP))) for d in ds], dt) / n,
        "k3_kl": _serial_sum([_k3(d, dt) for d in ds], dt) / n,
        "kl": _serial_sum([-d for d in ds], dt) / n,
        "log_ppl_diff": _serial_sum([-s / dt(len(row)) for row, s in full], dt) / r,
    }


def loop_weights(
    old,
    rollout,
    mask,
    *,
    level="token",
    mode="truncate",
    threshold=2.0,
    low=None,
    batch_normalize=False,
    dt=np.float64,
):
    """``(weights, keep, metrics)`` from the formulas, one token at a time."""
    b_, t_ = old.shape
    hi, lo = math.log(threshold), -math.inf if low is None else math.log(low)
    w = np.zeros((b_, t_), dt)
    keep = np.zeros((b_, t_), bool)
    ws, high, below = [], 0, 0
    for b, (row, cols) in enumerate(_rows(old, rollout, mask, dt)):
        s = _serial_sum(row, dt)
        for d, t in zip(row, cols, strict=True):
            lw = {"token": d, "sequence": s, "geometric": s / dt(max(len(row), 1))}[level]
            high, below = high + (lw > hi), below + (lw < lo)
            if mode == "truncate":
                keep[b, t] = True
                w[b, t] = np.exp(dt(min(max(lw, lo), min(hi, CAP))))
            else:
                keep[b, t] = lo <= lw <= hi
                w[b, t] = np.exp(min(lw, dt(CAP))) if keep[b, t] else 0
            ws.append(w[b, t])
    n = max(len(ws), 1)
    mean = _serial_sum(ws, dt) / n
    mean2 = _serial_sum([x * x for x in ws], dt) / n
    metrics = {
        "rollout_is_batch_norm_factor": dt(1),
        "rollout_is_eff_sample_size": mean * mean / mean2 if mean2 > 0 else dt(0),
        "rollout_is_max": max(ws, default=dt(0)),
        "rollout_is_mean": mean,
        "rollout_is_min": min(ws, default=dt(0)),
        "rollout_is_ratio_fraction_high": dt(high / n),
        "rollout_is_ratio_fraction_low": dt(below / n),
        **loop_mismatch(old, rollout, mask, dt),
    }
    if batch_normalize and mean > 0:
        w = w / mean
        metrics["rollout_is_batch_norm_factor"] = mean
    return w, keep, metrics


def _loop_bounds(option, spec):
    if option.endswith("k1"):
        lower, upper = spec if isinstance(spec, tuple) else (1 / spec, spec)
        return math.log(lower), math.log(upper)
    return -math.inf, spec


def _loop_statistics(rows, option, dt):
    """Per action token (token options) or per row with an action token (row options): the
    statistic of ``option``, and for each row the indices into that list of its tokens."""
    kind = option[:-3]
    stat = {"k1": lambda d: -d, "k2": lambda d: d * d / dt(2), "k3": lambda d: _k3(d, dt)}[
        option[-2:]
    ]
    values, owners = [], []
    for row, _ in rows:
        ks = [stat(d) for d in row]
        if kind == "token":
            owners.append(list(range(len(values), len(values) + len(ks))))
            values += ks
        elif row:
            owners.append([len(values)] * len(ks))
            total = _serial_sum(ks, dt)
            values.append(
                {"seq_sum": total, "seq_mean": total / dt(len(ks)), "seq_max": max(ks)}[kind]
            )
        else:
            owners.append([])
    return values, owners


def loop_rejection(old, rollout, mask, criteria, dt=np.float64):
    keep = mask.bool().numpy().copy()
    rows = _rows(old, rollout, mask, dt)
    n_tok, n_rows = sum(len(r) for r, _ in rows), sum(1 for r, _ in rows if r)
    metrics = {}
    for option, spec in criteria.items():
        lo, hi = _loop_bounds(option, spec)
        values, owners = _loop_statistics(rows, option, dt)
        masked = 0
        for b, ((_, cols), idx) in enumerate(zip(rows, owners, strict=True)):
            for t, i in zip(cols, idx, strict=True):
                ok = lo <= values[i] <= hi
                masked += not ok
                keep[b, t] &= ok
        p = f"rollout_rs_{option}"
        metrics[f"{p}_masked_fraction"] = masked / max(n_tok, 1)
        metrics[f"{p}_mean"] = _serial_sum(values, dt) / max(len(values), 1)
        metrics[f"{p}_max"] = max(values, default=0.0)
        metrics[f"{p}_min"] = min(values, default=0.0)
    m = mask.bool().numpy()
    lost = m & ~keep
    metrics["rollout_rs_masked_fraction"] = lost.sum() / max(n_tok, 1)
    metrics["rollout_rs_seq_masked_fraction"] = lost.any(-1).sum() / max(n_rows, 1)
    return keep, metrics


def _biting(option, old, rollout, mask):
    """A threshold for ``option`` that keeps some of the batch and rejects some: about the median
    of its statistic (k2, k3), or about the quartiles as ratio bounds (k1)."""
    values, _ = _loop_statistics(_rows(old, rollout, mask, np.float64), option, np.float64)
    v = sorted(values)

    def between(k):  # halfway between two neighbours: no value lies on the threshold
        return float((v[k - 1] + v[k]) / 2)

    if option.endswith("k1"):
        return (math.exp(between(len(v) // 4)), math.exp(between(3 * len(v) // 4)))
    return between(len(v) // 2)


# --------------------------------------------------------------------------- inputs
def _batch(seed, b=6, t=37, spread=0.3, dtype=F64):
    """Old and rollout log-probs with a tool span, right padding, an empty row, a one-action
    row, and NaN where the mask is 0."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3
    rollout = old - spread * torch.randn(b, t, generator=g, dtype=F64)
    mask = torch.rand(b, t, generator=g) > 0.2
    mask[:, 10:15] = False  # a tool span
    mask[1, 25:] = False  # right padding
    mask[2] = False  # no action token
    mask[3] = False
    mask[3, 7] = True  # one action token
    old = old.masked_fill(~mask, float("nan"))
    return old.to(dtype), rollout.to(dtype), mask


def _t(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x, dtype=np.float64))


def _assert_metrics(got: dict, oracle: dict, ref32: dict | None = None) -> None:
    assert sorted(got) == sorted(oracle)
    for k in oracle:
        g, o = got[k], _t(oracle[k])
        assert g.dim() == 0 and not g.requires_grad, k
        if ref32 is None:
            torch.testing.assert_close(g, o.to(g.dtype), rtol=1e-12, atol=1e-13, msg=k)
        else:
            assert_within_reference(k, g, o, _t(ref32[k]).to(F32))


IS_CASES = [
    (level, mode, threshold, low)
    for level in IS_LEVELS
    for mode in IS_MODES
    for threshold, low in ((2.0, None), (1.3, 0.8), (math.inf, None))
]


# --------------------------------------------------------------------------- hand-computed
def _two_by_three():
    old = torch.full((2, 3), -1.0, dtype=F64)
    rollout = torch.tensor([[-1.5, -1.0, -0.8], [-2.0, -0.5, -1.0]], dtype=F64)
    return old, rollout, torch.tensor([[1, 1, 1], [1, 1, 0]])  # d = [.5, 0, -.2], [1, -.5, ·]


def test_hand_computed_weights():
    old, rollout, mask = _two_by_three()
    e = math.exp
    cases = {
        ("token", "truncate", 1.5, None): [[1.5, 1, e(-0.2)], [1.5, e(-0.5), 0]],
        ("token", "truncate", 1.5, 0.7): [[1.5, 1, e(-0.2)], [1.5, 0.7, 0]],
        ("token", "mask", 1.5, 0.7): [[0, 1, e(-0.2)], [0, 0, 0]],
        ("sequence", "truncate", 1.5, None): [[e(0.3)] * 3, [1.5, 1.5, 0]],
        ("sequence", "mask", 1.5, None): [[e(0.3)] * 3, [0, 0, 0]],
        ("geometric", "truncate", 1.2, None): [[e(0.1)] * 3, [1.2, 1.2, 0]],
        ("geometric", "mask", 2.0, 1.2): [[0, 0, 0], [e(0.25), e(0.25), 0]],
    }
    for (level, mode, thr, low), want in cases.items():
        w, keep, m = rollout_importance_weights(
            old, rollout, mask, level=level, mode=mode, threshold=thr, low=low
        )
        torch.testing.assert_close(w, torch.tensor(want, dtype=F64), rtol=1e-15, atol=0)
        want_keep = mask.bool() if mode == "truncate" else torch.tensor(want) > 0
        assert torch.equal(keep, want_keep), (level, mode)
    w, _, m = rollout_importance_weights(old, rollout, mask, threshold=1.5)
    v = torch.tensor([1.5, 1, e(-0.2), 1.5, e(-0.5)], dtype=F64)
    assert m["rollout_is_eff_sample_size"].item() == pytest.approx(
        (v.mean() ** 2 / (v**2).mean()).item(), rel=1e-14
    )
    assert m["rollout_is_ratio_fraction_high"].item() == pytest.approx(0.4)
    assert m["rollout_is_min"].item() == pytest.approx(e(-0.5))
    assert m["kl"].item() == pytest.approx(-0.8 / 5)
    assert m["chi2_seq"].item() == pytest.approx((math.expm1(0.6) + math.expm1(1.0)) / 2)
    w, _, m = rollout_importance_weights(old, rollout, mask, threshold=1.5, batch_normalize=True)
    assert w.sum().item() == pytest.approx(5.0)
    assert m["rollout_is_batch_norm_factor"].item() == pytest.approx(v.mean().item())


def test_hand_computed_rejection():
    old, rollout, mask = _two_by_three()  # k1 = −d = [−.5, 0, .2], [−1, .5]
    cases = {
        "token_k1": ((0.7, 1.5), [[0, 1, 1], [0, 0, 0]]),  # log .7 = −.357, log 1.5 = .405
        "seq_sum_k1": (1.5, [[1, 1, 1], [0, 0, 0]]),  # sums −.3, −.5; bounds ±.405
        "seq_mean_k2": (0.07, [[1, 1, 1], [0, 0, 0]]),  # means .29/6 = .048, 1.25/4 = .31
        "seq_max_k3": (0.2, [[1, 1, 1], [0, 0, 0]]),  # maxes k3(.5) = .149, k3(1) = .718
        "token_k3": (0.12, [[0, 1, 1], [0, 1, 0]]),  # k3(−.5) = .107
    }
    for option, (spec, want) in cases.items():
        keep, m = rollout_rejection_mask(old, rollout, mask, {option: spec})
        assert keep.tolist() == [[bool(x) for x in r] for r in want], option
        lost = 5 - sum(map(sum, want))
        assert m["rollout_rs_masked_fraction"].item() == pytest.approx(lost / 5)
    keep, m = rollout_rejection_mask(old, rollout, mask, {"token_k3": 0.12, "seq_sum_k1": 1.5})
    assert keep.tolist() == [[False, True, True], [False, False, False]]
    assert m["rollout_rs_seq_masked_fraction"].item() == 1.0
    assert m["rollout_rs_token_k3_masked_fraction"].item() == pytest.approx(2 / 5)
    assert m["rollout_rs_seq_sum_k1_max"].item() == pytest.approx(-0.3)


# --------------------------------------------------------------------------- loop references
@pytest.mark.parametrize("level,mode,threshold,low", IS_CASES)
@pytest.mark.parametrize("normalize", [False, True])
def test_weights_match_loop_reference(level, mode, threshold, low, normalize):
    kw = dict(level=level, mode=mode, threshold=threshold, low=low, batch_normalize=normalize)
    old, rollout, mask = _batch(0)
    w, keep, m = rollout_importance_weights(old, rollout, mask, **kw)
    ow, okeep, om = loop_weights(old, rollout, mask, **kw)
    assert torch.equal(keep, torch.from_numpy(okeep))
    torch.testing.assert_close(w, _t(ow), rtol=1e-13, atol=0)
    _assert_metrics(m, om)
    # float32: within twice the float32 loop's error of the float64 loop
    w32, keep32, m32 = rollout_importance_weights(old.float(), rollout.float(), mask, **kw)
    rw, rkeep, rm = loop_weights(old.float(), rollout.float(), mask, dt=np.float32, **kw)
    assert w32.dtype == F32 and torch.equal(keep32, torch.from_numpy(rkeep))
    ow, _, om = loop_weights(old.float(), rollout.float(), mask, **kw)
    assert_within_reference("weights", w32, _t(ow), torch.from_numpy(rw))
    _assert_metrics(m32, om, rm)


@pytest.mark.parametrize("level", ["sequence", "geometric"])
@pytest.mark.parametrize("mode,threshold,low", [("truncate", math.inf, None), ("mask", 1e6, 1e-6)])
def test_long_rows_in_float32_within_the_loop_budget(level, mode, threshold, low):
    """Sequence log-weights summed over 2K tokens: the float32 result is as accurate as the
    float32 loop (blocked summation), weights and metrics."""
    kw = dict(level=level, mode=mode, threshold=threshold, low=low)
    old, rollout, mask = _batch(14, b=4, t=2048, spread=0.05)
    o32, r32 = old.float(), rollout.float()
    w, keep, m = rollout_importance_weights(o32, r32, mask, **kw)
    ow, okeep, om = loop_weights(o32, r32, mask, **kw)
    rw, _, rm = loop_weights(o32, r32, mask, dt=np.float32, **kw)
    assert torch.equal(keep, torch.from_numpy(okeep))
    assert_within_reference("weights", w, _t(ow), torch.from_numpy(rw))
    _assert_metrics(m, om, rm)


def test_thresholds_accept_numpy_and_0dim_tensors():
    old, rollout, mask = _batch(15)
    want = rollout_importance_weights(old, rollout, mask, mode="mask", threshold=1.5, low=0.5)
    for thr, low in ((np.float32(1.5), np.float64(0.5)), (torch.tensor(1.5), torch.tensor(0.5))):
        got = rollout_importance_weights(old, rollout, mask, mode="mask", threshold=thr, low=low)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    a = rollout_rejection_mask(
        old, rollout, mask, {"token_k1": (np.float32(0.5), 2), "seq_max_k3": torch.tensor(0.05)}
    )
    b = rollout_rejection_mask(old, rollout, mask, {"token_k1": (0.5, 2.0), "seq_max_k3": 0.05})
    assert torch.equal(a[0], b[0])


@pytest.mark.parametrize("option", RS_OPTIONS)
def test_rejection_matches_loop_reference(option):
    old, rollout, mask = _batch(1)
    for criteria in (
        {option: _biting(option, old, rollout, mask)},
        {
            option: _biting(option, old, rollout, mask),
            "token_k2": _biting("token_k2", old, rollout, mask) * 4,
        },
    ):
        keep, m = rollout_rejection_mask(old, rollout, mask, criteria)
        okeep, om = loop_rejection(old, rollout, mask, criteria)
        assert torch.equal(keep, torch.from_numpy(okeep)), criteria
        assert 0 < m["rollout_rs_masked_fraction"] < 1, criteria  # the criteria bite
        _assert_metrics(m, om)
        keep32, m32 = rollout_rejection_mask(old.float(), rollout.float(), mask, criteria)
        rkeep, rm = loop_rejection(old.float(), rollout.float(), mask, criteria, np.float32)
        _, om = loop_rejection(old.float(), rollout.float(), mask, criteria)
        assert torch.equal(keep32, torch.from_numpy(rkeep))
        _assert_metrics(m32, om, rm)


def test_single_k1_threshold_is_symmetric():
    old, rollout, mask = _batch(2)
    a = rollout_rejection_mask(old, rollout, mask, {"token_k1": 1.3})
    b = rollout_rejection_mask(old, rollout, mask, {"token_k1": (1 / 1.3, 1.3)})
    assert torch.equal(a[0], b[0])


def test_mismatch_metrics_match_loop_reference():
    old, rollout, mask = _batch(3, spread=1.0)
    _assert_metrics(rollout_mismatch_metrics(old, rollout, mask), loop_mismatch(old, rollout, mask))
    o32, r32 = old.float(), rollout.float()
    _assert_metrics(
        rollout_mismatch_metrics(o32, r32, mask),
        loop_mismatch(o32, r32, mask),
        loop_mismatch(o32, r32, mask, np.float32),
    )


# --------------------------------------------------------------------------- identities
@pytest.mark.parametrize("level,mode,threshold,low", IS_CASES)
def test_equal_logprobs_give_unit_weights(level, mode, threshold, low):
    old, _, mask = _batch(4, dtype=F32)
    w, keep, m = rollout_importance_weights(
        old, old, mask, level=level, mode=mode, threshold=threshold, low=low, batch_normalize=True
    )
    assert torch.equal(keep, mask) and torch.equal(w, mask.float())
    assert m["rollout_is_eff_sample_size"].item() == 1.0
    for k in (
        "kl",
        "k3_kl",
        "chi2_token",
        "chi2_seq",
        "log_ppl_diff",
        "rollout_is_ratio_fraction_high",
        "rollout_is_ratio_fraction_low",
    ):
        assert m[k].item() == 0.0, k
    for k in (
        "rollout_is_mean",
        "rollout_is_min",
        "rollout_is_max",
        "rollout_is_batch_norm_factor",
    ):
        assert m[k].item() == 1.0, k
    criteria = {o: (0.9, 1.1) if o.endswith("k1") else 1e-6 for o in RS_OPTIONS}
    keep, m = rollout_rejection_mask(old, old, mask, criteria)
    assert torch.equal(keep, mask) and m["rollout_rs_masked_fraction"].item() == 0.0


def test_one_action_rows_have_equal_levels():
    old, rollout, mask = _batch(5)
    old, mask = old.nan_to_num(-1.0), torch.zeros_like(mask)
    mask[:, 3] = True
    weights = [rollout_importance_weights(old, rollout, mask, level=lv)[0] for lv in IS_LEVELS]
    torch.testing.assert_close(weights[1], weights[0], rtol=0, atol=0)
    torch.testing.assert_close(weights[2], weights[0], rtol=0, atol=0)


# --------------------------------------------------------------------------- hazards
def _all_finite(*parts) -> bool:
    ts = [t for p in parts for t in (p.values() if isinstance(p, dict) else [p])]
    return all(bool(torch.isfinite(t.float()).all()) for t in ts)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_log_ratios_of_50_stay_finite(dtype):
    old = torch.full((2, 4), -1.0, dtype=dtype)
    rollout = old - torch.tensor([[50.0, -50.0, 0.0, 50.0], [-50.0, -50.0, 1.0, 0.0]], dtype=dtype)
    mask = torch.ones(2, 4)
    for level in IS_LEVELS:
        for threshold in (2.0, math.inf):
            w, keep, m = rollout_importance_weights(
                old, rollout, mask, level=level, threshold=threshold, batch_normalize=True
            )
            assert w.dtype == F32 and _all_finite(w, m), (level, threshold)
            w, keep, m = rollout_importance_weights(
                old, rollout, mask, level=level, mode="mask", threshold=threshold, low=0.5
            )
            assert _all_finite(w, m), (level, threshold)
    w, _, m = rollout_importance_weights(old, rollout, mask, threshold=math.inf)
    assert w[0, 0].item() == pytest.approx(math.exp(CAP), rel=1e-6)
    assert m["chi2_token"].item() > 1e16  # e^40 per saturated token, finite
    keep, m = rollout_rejection_mask(old, rollout, mask, {o: 2.0 for o in RS_OPTIONS})
    assert _all_finite(m) and not keep[0].any()


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_32k_token_rows(dtype):
    t = 32768
    old = torch.full((2, t), -2.0, dtype=dtype)
    rollout = (old.float() - 0.01).to(dtype)
    mask = torch.ones(2, t, dtype=torch.bool)
    mask[1, t // 2 :] = False
    d = (old.float() - rollout.float())[0, 0].item()  # 0.01 as the dtype holds it
    w, keep, m = rollout_importance_weights(old, rollout, mask, level="sequence")
    assert _all_finite(w, m) and (w[mask] == 2.0).all()  # exp(327.7) truncated to 2
    assert m["rollout_is_ratio_fraction_high"].item() == 1.0
    assert m["chi2_seq"].item() == pytest.approx(math.expm1(2 * CAP), rel=1e-6)
    w, keep, m = rollout_importance_weights(
        old, rollout, mask, level="sequence", mode="mask", threshold=math.inf, batch_normalize=True
    )
    assert _all_finite(w, m) and torch.equal(keep, mask)
    torch.testing.assert_close(w[mask], torch.ones_like(w[mask]))  # e^20 normalised back
    w, _, m = rollout_importance_weights(old, rollout, mask, level="geometric")
    torch.testing.assert_close(w[mask], torch.full_like(w[mask], math.exp(d)))
    assert _all_finite(m) and m["kl"].item() == pytest.approx(-d, rel=1e-5)
    keep, m = rollout_rejection_mask(old, rollout, mask, {"seq_sum_k3": 0.5, "seq_mean_k1": 2.0})
    assert _all_finite(m) and not keep.any()  # Σ k3 is 1.6 over 32K tokens, 0.8 over 16K
    assert m["rollout_rs_seq_sum_k3_max"].item() == pytest.approx(t * (math.expm1(d) - d), rel=1e-3)


def test_all_masked_rows_and_batches():
    old, rollout, mask = _batch(6)
    assert not mask[2].any()
    for level in IS_LEVELS:
        for mode in IS_MODES:
            w, keep, m = rollout_importance_weights(old, rollout, mask, level=level, mode=mode)
            assert _all_finite(w, m) and (w[2] == 0).all() and not keep[2].any()
    empty = torch.zeros_like(mask)
    w, keep, m = rollout_importance_weights(
        old, rollout, empty, level="sequence", batch_normalize=True
    )
    assert (w == 0).all() and not keep.any()
    assert all(v.item() == 0 for k, v in m.items() if k != "rollout_is_batch_norm_factor")
    keep, m = rollout_rejection_mask(old, rollout, empty, {"seq_max_k3": 0.1, "token_k1": 2.0})
    assert not keep.any() and all(v.item() == 0 for v in m.values())
    m = rollout_mismatch_metrics(old, rollout, empty)
    assert all(v.item() == 0 for v in m.values())
    w, keep, m = rollout_importance_weights(old[:, :0], rollout[:, :0], mask[:, :0])
    assert w.shape == (6, 0) and _all_finite(m)
    keep, m = rollout_rejection_mask(old[:0], rollout[:0], mask[:0], {"seq_max_k2": 1.0})
    assert keep.shape == (0, 37) and _all_finite(m)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_inputs_are_computed_in_float32(half):
    old, rollout, mask = _batch(7)
    old, rollout = old.to(half), rollout.to(half)
    kw = dict(level="geometric", mode="mask", threshold=1.2, low=0.9, batch_normalize=True)
    w, keep, m = rollout_importance_weights(old, rollout, mask, **kw)
    w32, keep32, m32 = rollout_importance_weights(old.float(), rollout.float(), mask, **kw)
    assert w.dtype == F32 and torch.equal(w, w32) and torch.equal(keep, keep32)
    assert all(m[k].dtype == F32 and torch.equal(m[k], m32[k]) for k in m)
    crit = {"seq_mean_k3": 0.02, "token_k1": 1.5}
    keep, m = rollout_rejection_mask(old, rollout, mask, crit)
    keep32, m32 = rollout_rejection_mask(old.float(), rollout.float(), mask, crit)
    assert torch.equal(keep, keep32) and all(torch.equal(m[k], m32[k]) for k in m)


def test_outputs_are_detached():
    old, rollout, mask = _batch(8, dtype=F32)
    old.requires_grad_(True)
    w, _, m = rollout_importance_weights(old, rollout, mask, level="sequence")
    assert not w.requires_grad and not any(v.requires_grad for v in m.values())
    assert not any(v.requires_grad for v in rollout_mismatch_metrics(old, rollout, mask).values())


# --------------------------------------------------------------------------- meta: no host read
def _calls(dev):
    g = torch.Generator().manual_seed(9)
    old = -torch.rand(4, 50, generator=g).to(dev)
    rollout = -torch.rand(4, 50, generator=g).to(torch.bfloat16).to(dev)
    mask = (torch.rand(4, 50, generator=g) > 0.3).to(dev)
    return [
        lambda: rollout_importance_weights(
            old, rollout, mask, level="sequence", mode="mask", low=0.5, batch_normalize=True
        ),
        lambda: rollout_importance_weights(old, rollout, mask.float(), level="geometric"),
        lambda: rollout_rejection_mask(old, rollout, mask, {o: 2.0 for o in RS_OPTIONS}),
        lambda: rollout_mismatch_metrics(old, rollout, mask),
    ]


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [out[k] for k in sorted(out)]
    return [t for part in out for t in _flat(part)]


def test_runs_on_meta_without_reading_values(monkeypatch):
    monkeypatch.delenv("RLOPS_CHECK_VALUES", raising=False)
    for k, (on_cpu, on_meta) in enumerate(zip(_calls("cpu"), _calls("meta"), strict=True)):
        want, got = _flat(on_cpu()), _flat(on_meta())
        assert [(o.shape, o.dtype) for o in got] == [(o.shape, o.dtype) for o in want], k
        assert all(o.device.type == "meta" for o in got), k


# --------------------------------------------------------------------------- bad input
def test_bad_input_names_the_argument():
    old, rollout, mask = _batch(10, dtype=F32)

    def w(**kw):
        return rollout_importance_weights(old, rollout, mask, **kw)

    with pytest.raises(ValueError, match="level must be one of"):
        w(level="seq")
    with pytest.raises(ValueError, match="mode must be one of"):
        w(mode="clip")
    with pytest.raises(ValueError, match="low must be <= threshold"):
        w(threshold=1.5, low=2.0)
    with pytest.raises(ValueError, match="threshold must be > 0"):
        w(threshold=0.0)
    with pytest.raises(ValueError, match="low must be > 0"):
        w(low=-1.0)
    with pytest.raises(TypeError, match="threshold must be a real number"):
        w(threshold="2.0")
    with pytest.raises(TypeError, match="batch_normalize must be a bool"):
        w(batch_normalize=1)
    with pytest.raises(ValueError, match=r"rollout_logp must have shape \[6, 37\]"):
        rollout_importance_weights(old, rollout[:, :5], mask)
    with pytest.raises(ValueError, match=r"mask must have shape \[6, 37\]"):
        rollout_importance_weights(old, rollout, mask[:5])
    with pytest.raises(ValueError, match=r"old_logp must have shape \[B, T\]"):
        rollout_mismatch_metrics(old[0], rollout[0], mask[0])
    with pytest.raises(TypeError, match="rollout_logp must be a floating-point tensor"):
        rollout_mismatch_metrics(old, mask.long(), mask)
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        rollout_mismatch_metrics(old, rollout, mask.float() * 2)

    def rs(criteria):
        return rollout_rejection_mask(old, rollout, mask, criteria)

    with pytest.raises(ValueError, match="criteria option must be one of"):
        rs({"seq_max_k1": 2.0})
    with pytest.raises(ValueError, match="criteria must be a non-empty mapping"):
        rs({})
    with pytest.raises(ValueError, match="criteria must be a non-empty mapping"):
        rs("token_k1")
    with pytest.raises(ValueError, match=r"criteria\['token_k1'\] lower must be <= "):
        rs({"token_k1": (2.0, 0.5)})
    with pytest.raises(ValueError, match=r"criteria\['seq_sum_k1'\] lower \(1/upper\)"):
        rs({"seq_sum_k1": 0.5})
    with pytest.raises(TypeError, match=r"criteria\['seq_mean_k3'\] must be one upper bound"):
        rs({"seq_mean_k3": (0.1, 0.2)})
    with pytest.raises(ValueError, match=r"criteria\['token_k2'\] must be > 0"):
        rs({"token_k2": -1.0})
    with pytest.raises(ValueError, match=r"criteria\['token_k1'\] must be \(lower, upper\)"):
        rs({"token_k1": (0.5, 1.0, 2.0)})
    with pytest.raises(TypeError, match=r"group must be a torch\.distributed\.ProcessGroup"):
        rollout_mismatch_metrics(old, rollout, mask, group="dp")


# --------------------------------------------------------------------------- group=
def _shards():
    """Two ranks' batches of the same T; rank 1 also holds an empty row."""
    a, b = _batch(11, b=5), _batch(12, b=4)
    return [a, b]


def _on_rank(rank: int, world: int):
    group = dist.group.WORLD
    old, rollout, mask = _shards()[rank]
    out = {}
    with count_collectives() as calls:
        out["is"] = rollout_importance_weights(
            old,
            rollout,
            mask,
            level="sequence",
            mode="mask",
            threshold=1.5,
            low=0.5,
            batch_normalize=True,
            group=group,
        )
    out["is_calls"] = dict(calls)
    with count_collectives() as calls:
        out["rs"] = rollout_rejection_mask(
            old, rollout, mask, {"token_k1": 1.5, "seq_mean_k3": 0.03}, group=group
        )
    out["rs_calls"] = dict(calls)
    with count_collectives() as calls:
        out["mm"] = rollout_mismatch_metrics(old, rollout, mask, group=group)
    out["mm_calls"] = dict(calls)
    # a rank without action tokens joins and contributes nothing
    empty = torch.zeros_like(mask) if rank == 1 else mask
    out["empty"] = rollout_importance_weights(
        old, rollout, empty, level="token", batch_normalize=True, group=group
    )
    return out


@pytest.mark.distributed
def test_group_equals_concatenated_batch_with_one_collective():
    results = run_distributed(_on_rank, 2)
    shards = _shards()
    old, rollout, mask = (torch.cat(p) for p in zip(*shards, strict=True))
    rows = [s[0].shape[0] for s in shards]
    w, keep, m = rollout_importance_weights(
        old,
        rollout,
        mask,
        level="sequence",
        mode="mask",
        threshold=1.5,
        low=0.5,
        batch_normalize=True,
    )
    rkeep, rm = rollout_rejection_mask(old, rollout, mask, {"token_k1": 1.5, "seq_mean_k3": 0.03})
    mm = rollout_mismatch_metrics(old, rollout, mask)
    empty_mask = torch.cat([shards[0][2], torch.zeros_like(shards[1][2])])
    ew, _, em = rollout_importance_weights(old, rollout, empty_mask, batch_normalize=True)
    start = 0
    for out, n in zip(results, rows, strict=True):
        sl = slice(start, start + n)
        start += n
        assert out["is_calls"] == out["rs_calls"] == out["mm_calls"] == {"all_gather": 1}
        torch.testing.assert_close(out["is"][0], w[sl])
        assert torch.equal(out["is"][1], keep[sl]) and torch.equal(out["rs"][0], rkeep[sl])
        torch.testing.assert_close(out["empty"][0], ew[sl])
        for got, want in (
            (out["is"][2], m),
            (out["rs"][1], rm),
            (out["mm"], mm),
            (out["empty"][2], em),
        ):
            assert sorted(got) == sorted(want)
            for k in want:
                torch.testing.assert_close(got[k], want[k], msg=k)


def test_no_collective_without_group():
    old, rollout, mask = _batch(13)
    with count_collectives() as calls:
        rollout_importance_weights(old, rollout, mask, batch_normalize=True)
        rollout_rejection_mask(old, rollout, mask, {"seq_max_k2": 0.5})
    assert not calls


# --------------------------------------------------------------------------- cp_group=
CP_CRITERIA = [
    {"token_k1": (0.5, 1.8), "seq_mean_k3": 0.05, "seq_max_k2": 0.25, "seq_sum_k1": (0.3, 30.0)},
    {"token_k1": (0.5, 1.8)},  # rows that lost a token, over tokens of both ranks
]
CP_IS = [
    dict(level="sequence", mode="mask", threshold=1.5, low=0.5, batch_normalize=True),
    dict(level="geometric", threshold=1.05, low=0.97),
]


def _zigzag(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    from rlops.distributed import zigzag_shard

    return zigzag_shard(x, cp_size=world, cp_rank=rank)


def _on_cp_rank(rank: int, world: int):
    group = dist.group.WORLD
    old, rollout, mask = _batch(16, b=5, t=37)
    old, rollout = (_zigzag(x.nan_to_num(0.0), rank, world) for x in (old, rollout))
    mask = _zigzag(mask.long(), rank, world).bool()
    out = {"is": [], "calls": []}
    for kw in CP_IS:
        with count_collectives() as calls:
            out["is"].append(
                rollout_importance_weights(old, rollout, mask, group=group, cp_group=group, **kw)
            )
        out["calls"].append(dict(calls))
    out["rs"] = []
    for criteria in CP_CRITERIA:
        with count_collectives() as calls:
            out["rs"].append(
                rollout_rejection_mask(old, rollout, mask, criteria, group=group, cp_group=group)
            )
        out["calls"].append(dict(calls))
    with count_collectives() as calls:
        out["mm"] = rollout_mismatch_metrics(old, rollout, mask, group=group, cp_group=group)
    out["calls"].append(dict(calls))
    return out


@pytest.mark.distributed
def test_context_parallel_rows_equal_whole_rows():
    """Rows split over 2 CP ranks (zigzag): sequence weights, row rejection and every metric
    equal the single-process result on whole rows; two collectives per call (the row
    summaries over cp_group, the metrics over group)."""
    results = run_distributed(_on_cp_rank, 2)
    old, rollout, mask = _batch(16, b=5, t=37)
    want_is = [rollout_importance_weights(old, rollout, mask, **kw) for kw in CP_IS]
    want_rs = [rollout_rejection_mask(old, rollout, mask, c) for c in CP_CRITERIA]
    want_mm = rollout_mismatch_metrics(old, rollout, mask)
    for _, m in want_rs:
        assert 0 < m["rollout_rs_masked_fraction"] < 1
        assert 0 < m["rollout_rs_seq_masked_fraction"]
    assert 0 < want_is[0][2]["rollout_is_ratio_fraction_high"] < 1
    for rank, out in enumerate(results):
        assert out["calls"] == [{"all_gather": 2}] * 5
        for (w, keep, m), (ww, wkeep, wm) in zip(out["is"], want_is, strict=True):
            torch.testing.assert_close(w, _zigzag(ww, rank, 2))
            assert torch.equal(keep, _zigzag(wkeep.long(), rank, 2).bool())
            assert sorted(m) == sorted(wm)
            for k in wm:
                torch.testing.assert_close(m[k], wm[k], msg=k)
        for (keep, _), (wkeep, _) in zip(out["rs"], want_rs, strict=True):
            assert torch.equal(keep, _zigzag(wkeep.long(), rank, 2).bool())
        pairs = [(g[1], w[1]) for g, w in zip(out["rs"], want_rs, strict=True)]
        for got, want in (*pairs, (out["mm"], want_mm)):
            assert sorted(got) == sorted(want)
            for k in want:
                torch.testing.assert_close(got[k], want[k], msg=k)


# --------------------------------------------------------------------------- bad layout keywords
def _inputs():
    g = torch.Generator().manual_seed(0)
    return (
        -torch.rand(3, 5, generator=g) - 0.1,
        -torch.rand(3, 5, generator=g) - 0.1,
        torch.ones(3, 5),
    )


CALLS = {
    "rollout_importance_weights": lambda **kw: rollout_importance_weights(*_inputs(), **kw),
    "rollout_rejection_mask": lambda **kw: rollout_rejection_mask(
        *_inputs(), {"token_k1": (0.5, 2.0)}, **kw
    ),
    "rollout_mismatch_metrics": lambda **kw: rollout_mismatch_metrics(*_inputs(), **kw),
}


@pytest.mark.parametrize("fn", sorted(CALLS))
@pytest.mark.parametrize(("kw", "exc", "arg", "words"), BAD_LAYOUT, ids=BAD_LAYOUT_IDS)
def test_bad_layout_keyword_raises_naming_it(fn, kw, exc, arg, words):
    """A bad layout keyword is a ValueError / TypeError naming the argument and what it
    accepts (the same list as the losses': tests/losses/test_options.py)."""
    with pytest.raises(exc, match=names(arg)) as info:
        CALLS[fn](**kw)
    assert words in str(info.value)


@pytest.mark.parametrize("fn", sorted(CALLS))
def test_valid_layout_runs(fn):
    out = CALLS[fn](seq_ids=LAYOUT_IDS, seqs_per_row=2, cp_layout="contiguous")
    assert out is not None
