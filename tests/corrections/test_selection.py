"""Selection masks (``rlops.corrections.selection``) against float64 definitions written from
the papers and against each peer's own formula (AReaL's M2PO and behaviour weights, TRL's
entropy quantile, slime's OPSM), restated plainly here; the batch-wide ones over 2 Gloo ranks
against one process; bad input named in the error."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from tests._bad_input import names
from tests._distributed import run_distributed

from rlops.corrections.selection import (
    behavior_importance_weights,
    m2po_mask,
    opsm_mask,
    top_entropy_mask,
)


def _batch(seed, b=6, t=9, scale=0.3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    rollout = old + scale * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.75
    mask[0] = False  # a row without action tokens
    return old.to(dtype), rollout.to(dtype), mask


# --------------------------------------------------------------------------- M2PO
def areal_m2po(old, rollout, mask, tau):
    """AReaL's ``get_m2po_loss_mask`` on the micro-batch, restated: sort d² descending, mask
    the first k where k is the first index whose suffix mean is < tau (else n − 1)."""
    m2 = ((old - rollout) ** 2)[mask]
    order = torch.argsort(m2, descending=True)
    s = m2[order]
    n = s.numel()
    k = n - 1
    for i in range(n):
        if s[i:].mean() < tau:
            k = i
            break
    kept = torch.ones(n, dtype=torch.bool)
    kept[order[:k]] = False
    out = torch.zeros_like(mask)
    out[mask] = kept
    return out


def paper_m2po(old, rollout, mask, tau):
    """M2PO's constraint from the paper: the largest set of smallest d² whose mean is < tau
    (values only; ties at the cut dropped), in float64 with a loop over the distinct values."""
    m2 = (old.double() - rollout.double()) ** 2
    vals = sorted(set(m2[mask].tolist()))
    keep_upto = None
    for v in vals:
        sel = m2[mask][m2[mask] <= v]
        if sel.mean() < tau:
            keep_upto = v
    if keep_upto is None:
        return mask & (m2 == min(vals))
    return mask & (m2 <= keep_upto)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tau", [1e-3, 0.02, 0.05, 0.2, 10.0])
def test_m2po_matches_areal_and_the_paper(dtype, tau):
    for seed in range(4):
        old, rollout, mask = _batch(seed, dtype=dtype)
        keep, m = m2po_mask(old, rollout, mask, threshold=tau)
        assert torch.equal(keep, areal_m2po(old, rollout, mask, tau))
        assert torch.equal(keep, paper_m2po(old, rollout, mask, tau))
        d2 = (old.double() - rollout.double()) ** 2
        assert math.isclose(float(m["m2po_m2_kept"]), float(d2[keep].mean()), rel_tol=1e-5)
        assert math.isclose(float(m["m2po_m2"]), float(d2[mask].mean()), rel_tol=1e-5)
        assert float(m["m2po_masked_fraction"]) == pytest.approx(
            1 - keep.sum().item() / mask.sum().item()
        )
        if keep.sum() > 1:
            assert float(m["m2po_m2_kept"]) < tau


def test_m2po_ties_and_edges_hand_computed():
    d = torch.tensor([[0.3, 0.3, 0.1, 0.0]])
    ones = torch.ones(1, 4)
    # d² = .09 .09 .01 0 (mean 0.0475): with tau = 0.04, keeping one 0.09 gives a mean of
    # 0.0333 < 0.04 (AReaL keeps whichever its sort puts last), but the tie is dropped whole
    keep, m = m2po_mask(d, torch.zeros(1, 4), ones, threshold=0.04)
    assert keep.tolist() == [[False, False, True, True]]
    assert float(m["m2po_cut"]) == pytest.approx(0.09)
    # every value >= tau: the smallest (and its ties) kept
    keep, _ = m2po_mask(
        torch.tensor([[1.0, -1.0, 2.0]]), torch.zeros(1, 3), torch.ones(1, 3), threshold=0.5
    )
    assert keep.tolist() == [[True, True, False]]
    # nothing to drop
    keep, m = m2po_mask(d, torch.zeros(1, 4), ones, threshold=1.0)
    assert keep.all() and math.isinf(float(m["m2po_cut"]))
    # no action token
    keep, m = m2po_mask(d, torch.zeros(1, 4), torch.zeros(1, 4), threshold=1.0)
    assert not keep.any() and float(m["m2po_masked_fraction"]) == 0


# --------------------------------------------------------------------------- entropy quantile
def trl_entropy_mask(h, mask, rho):
    """TRL's ``get_high_entropy_mask(entropies, mask, 1 − top_entropy_quantile)`` restated."""
    local = h[mask.bool()].float()
    if local.numel() == 0:
        return torch.zeros_like(h, dtype=torch.bool)
    q = torch.quantile(local, 1 - rho)
    return (h * mask.float() >= q) & mask.bool()


@pytest.mark.parametrize("rho", [0.0, 0.2, 0.3, 0.5, 0.7, 0.8, 1.0])
def test_top_entropy_matches_trl(rho):
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        h = torch.rand(5, 13, generator=g) * 3
        h[1, :4] = h[2, 5]  # ties
        mask = torch.rand(5, 13, generator=g) < 0.7
        keep, m = top_entropy_mask(h, mask, rho=rho)
        assert torch.equal(keep, trl_entropy_mask(h, mask, rho))
        assert float(m["entropy_kept_fraction"]) == pytest.approx(
            keep.sum().item() / mask.sum().item()
        )


def test_top_entropy_paper_definition_float64():
    """The top-ρ fraction: with n = 11 distinct entropies and ρ = 0.2, p = 10·0.8 = 8 (an
    integer): the 3 largest are kept."""
    h = torch.arange(11, dtype=torch.float64).reshape(1, 11) / 7
    keep, m = top_entropy_mask(h, torch.ones(1, 11), rho=0.2)
    assert keep.tolist() == [[False] * 8 + [True] * 3]
    assert float(m["entropy_threshold"]) == pytest.approx(8 / 7)


def test_top_entropy_trl_documented_example():
    h = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    keep, _ = top_entropy_mask(h, mask, rho=0.2)
    expected = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0]]).bool()
    assert torch.equal(keep, expected)
    keep, m = top_entropy_mask(h, torch.zeros(2, 6), rho=0.2)
    assert not keep.any() and float(m["entropy_threshold"]) == 0


def test_top_entropy_bfloat16_matches_trl_on_the_widened_values():
    g = torch.Generator().manual_seed(4)
    h = (torch.rand(4, 33, generator=g) * 2).bfloat16()  # many ties after rounding
    mask = torch.rand(4, 33, generator=g) < 0.8
    for rho in (0.1, 0.2, 0.5):
        keep, _ = top_entropy_mask(h, mask, rho=rho)
        assert torch.equal(keep, trl_entropy_mask(h, mask, rho))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(0, 3, width=32), min_size=1, max_size=40),
    st.floats(1e-3, 2.0),
    st.floats(0.0, 1.0),
    st.randoms(use_true_random=False),
)
def test_masks_depend_on_values_only(values, tau, rho, rnd):
    """A permutation of the tokens permutes the masks; M2PO's kept mean is < tau unless only
    the smallest value (and its ties) is left, and putting back the smallest dropped value
    breaks the bound (the kept set is the largest); the entropy mask is {H ≥ q}."""
    x = torch.tensor(values, dtype=torch.float32)[None]
    perm = list(range(x.shape[1]))
    rnd.shuffle(perm)
    ones = torch.ones_like(x, dtype=torch.bool)
    keep, _ = m2po_mask(x, torch.zeros_like(x), ones, threshold=tau)
    keep_p, _ = m2po_mask(x[:, perm], torch.zeros_like(x), ones, threshold=tau)
    assert torch.equal(keep[:, perm], keep_p)
    d2 = x.square().double()[0]  # the float32 squares the mask is made of
    kept = d2[keep[0]]
    if kept.mean() >= tau:
        assert bool((kept == d2.min()).all())
    dropped = d2[~keep[0]]
    if dropped.numel():
        more = d2[d2 <= dropped.min()]
        assert more.mean() >= tau
    e_keep, m = top_entropy_mask(x, ones, rho=rho)
    e_keep_p, _ = top_entropy_mask(x[:, perm], ones, rho=rho)
    assert torch.equal(e_keep[:, perm], e_keep_p)
    assert torch.equal(e_keep, x >= m["entropy_threshold"])


# --------------------------------------------------------------------------- OPSM
def paper_opsm(logp, old, adv, mask, delta):
    """DeepSeek-V3.2 eq. 9 as a loop over rows in float64."""
    keep = mask.clone().bool()
    for b in range(logp.shape[0]):
        sel = mask[b].bool()
        kl = float((old[b][sel].double() - logp[b][sel].double()).sum()) / max(int(sel.sum()), 1)
        for t in range(logp.shape[1]):
            if sel[t] and adv[b, t] < 0 and kl > delta:
                keep[b, t] = False
    return keep


@pytest.mark.parametrize("delta", [-1.0, 0.0, 1e-4, 0.05])
def test_opsm_matches_the_paper(delta):
    old, logp, mask = _batch(3, scale=0.1)
    adv = torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=old.dtype)
    keep, m = opsm_mask(logp, old, adv, mask, delta=delta)
    ref = paper_opsm(logp, old, adv, mask, delta)
    assert torch.equal(keep, ref)
    assert float(m["opsm_masked_fraction"]) == pytest.approx(
        (mask & ~ref).sum().item() / mask.sum().item()
    )


# --------------------------------------------------------------------------- behaviour weights
def areal_behave(prox, behav, mask, upper, lower, level, agg, action):
    """AReaL's ``apply_rejection_sampling(metric="ratio")`` restated per row in float64."""
    lr = prox.double() - behav.double()
    w = torch.exp(lr)
    keep = mask.clone().bool()

    def inside(s):
        return (s <= upper) and (lower is None or s >= lower)

    for b in range(lr.shape[0]):
        sel = mask[b].bool()
        n = max(int(sel.sum()), 1)
        if level == "token":
            for t in range(lr.shape[1]):
                if not sel[t]:
                    continue
                if action == "mask":
                    keep[b, t] = inside(float(w[b, t]))
                else:
                    w[b, t] = min(max(float(w[b, t]), lower or 0.0), upper)
            continue
        geo = math.exp(float(lr[b][sel].sum()) / n)
        s = {
            "sum": math.exp(float(lr[b][sel].sum())),
            "mean": geo,
            "max": math.exp(float(lr[b][sel].max())) if sel.any() else 1.0,
        }[agg]
        w[b] = geo
        if not inside(s):
            if action == "mask":
                keep[b] = False
            else:
                w[b] = min(max(geo, lower or 0.0), upper)
    keep &= mask.bool()
    original = (
        torch.exp(lr)
        if level == "token"
        else torch.stack(
            [
                torch.full(
                    (lr.shape[1],),
                    math.exp(float(lr[b][mask[b].bool()].sum()) / max(int(mask[b].sum()), 1)),
                    dtype=lr.dtype,
                )
                for b in range(lr.shape[0])
            ]
        )
    )
    changed = (mask.bool() & ~keep) if action == "mask" else (mask.bool() & (w != original))
    filtered = changed.sum().item() / max(mask.sum().item(), 1)
    return torch.where(keep, w, 0), keep, filtered


@pytest.mark.parametrize(
    "level,agg", [("token", "mean"), ("sequence", "sum"), ("sequence", "mean"), ("sequence", "max")]
)
@pytest.mark.parametrize("action", ["mask", "clamp"])
@pytest.mark.parametrize("lower", [None, 0.8])
def test_behavior_weights_match_areal(level, agg, action, lower):
    old, rollout, mask = _batch(7, scale=0.15)
    rollout = rollout + torch.linspace(-0.6, 0.6, old.shape[0], dtype=old.dtype)[:, None]
    w, keep, m = behavior_importance_weights(
        old, rollout, mask, upper=1.25, lower=lower, level=level, agg=agg, action=action
    )
    rw, rkeep, filtered = areal_behave(old, rollout, mask, 1.25, lower, level, agg, action)
    assert torch.equal(keep, rkeep)
    torch.testing.assert_close(w, rw, rtol=1e-12, atol=0)
    assert float(m["behave_filtered_fraction"]) == pytest.approx(filtered, rel=1e-12)
    if not (action == "clamp" and level == "sequence" and agg != "mean"):
        assert filtered > 0  # (clamping a geometric mean inside the bounds changes none)
    kept_mean = float(rw[rkeep].mean()) if rkeep.any() else 0.0  # 0 when nothing is kept
    assert float(m["behave_imp_weight_mean"]) == pytest.approx(kept_mean, rel=1e-12)


def test_bad_arguments_name_themselves():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="threshold"):
        m2po_mask(z, z, torch.ones(2, 3), threshold=0.0)
    with pytest.raises(ValueError, match="rho"):
        top_entropy_mask(z, torch.ones(2, 3), rho=1.5)
    with pytest.raises(ValueError, match="agg"):
        behavior_importance_weights(z, z, torch.ones(2, 3), upper=2.0, agg="median")
    with pytest.raises(ValueError, match="mask"):
        opsm_mask(z, z, z, torch.ones(2, 2))


# --------------------------------------------------------------------------- Gloo ranks
# rows of the whole batch held by each rank: 4 ranks (one holds nothing), and two groups of 2
# ranks each splitting the same batch differently
QUARTERS = [(0, 1), (1, 3), (3, 3), (3, 8)]
HALVES = [(0, 3), (3, 8), (0, 6), (6, 8)]


def _split_work(rank, world, batches, ent):
    import os

    from tests._distributed import count_collectives

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    out = {}
    for name, (old, rollout, mask) in batches.items():
        h = ent.to(old.dtype)
        for split, rows, grp in (
            ("4", QUARTERS[rank], dist.group.WORLD),
            ("2", HALVES[rank], pair),
        ):
            r = slice(*rows)
            with count_collectives() as calls:
                keep_m, met_m = m2po_mask(old[r], rollout[r], mask[r], threshold=0.02, group=grp)
            n_m = sum(calls.values())
            keep_e, met_e = top_entropy_mask(h[r], mask[r], rho=0.2, group=grp)
            out[name, split] = (keep_m, keep_e, met_m, met_e, n_m)
        os.environ["RLOPS_GROUP_CHECK"] = "0"
        with count_collectives() as calls:
            m2po_mask(
                old[slice(*QUARTERS[rank])],
                rollout[slice(*QUARTERS[rank])],
                mask[slice(*QUARTERS[rank])],
                threshold=0.02,
                group=dist.group.WORLD,
            )
        del os.environ["RLOPS_GROUP_CHECK"]
        out[name, "unchecked"] = sum(calls.values())
    # context parallel over a pair: columns split between its two ranks
    old, rollout, mask = batches["float64"]
    half = old.shape[1] // 2
    cols = slice(0, half) if rank % 2 == 0 else slice(half, old.shape[1])
    w, keep, _ = behavior_importance_weights(
        old[:, cols],
        rollout[:, cols],
        mask[:, cols],
        upper=1.2,
        level="sequence",
        agg="max",
        cp_group=pair,
    )
    opsm, _ = opsm_mask(
        rollout[:, cols], old[:, cols], old[:, cols] - 1, mask[:, cols], delta=0.01, cp_group=pair
    )
    out["cp"] = (w, keep, opsm)
    q = slice(*QUARTERS[rank])
    out["behave"] = behavior_importance_weights(
        old[q],
        rollout[q],
        mask[q],
        upper=1.1,
        level="token",
        action="clamp",
        group=dist.group.WORLD,
    )[2]
    return out


@pytest.mark.distributed
def test_group_masks_equal_the_whole_batch_for_splits_1_2_4():
    """The mask of each rank, concatenated in rank order, equals the one-process mask of the
    whole batch for the batch split over 1 (one process), 2 (two groups of 2 ranks, split
    differently) and 4 ranks (one holding no row); float32 (4 radix rounds) and float64 (8)."""
    batches = {
        str(dt).split(".")[1]: _batch(11, b=8, t=10, dtype=dt)
        for dt in (torch.float32, torch.float64)
    }
    ent = torch.rand(8, 10, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    res = run_distributed(_split_work, 4, batches, ent)
    for name, (old, rollout, mask) in batches.items():
        whole_m, wm = m2po_mask(old, rollout, mask, threshold=0.02)
        whole_e, we = top_entropy_mask(ent.to(old.dtype), mask, rho=0.2)
        assert 0 < wm["m2po_masked_fraction"] < 1
        rounds = 4 if name == "float32" else 8
        for split, ranks in (("4", [0, 1, 2, 3]), ("2", [0, 1]), ("2", [2, 3])):
            parts = [res[r][name, split] for r in ranks]
            assert torch.equal(torch.cat([p[0] for p in parts]), whole_m), (name, split)
            assert torch.equal(torch.cat([p[1] for p in parts]), whole_e), (name, split)
            for p in parts:
                for k in wm:
                    torch.testing.assert_close(p[2][k], wm[k], rtol=1e-6, atol=0)
                assert torch.equal(p[3]["entropy_threshold"], we["entropy_threshold"])
                # one checked gather per radix round: its fixed-size check, then the bins
                assert p[4] == 2 * rounds
        assert all(res[r][name, "unchecked"] == rounds for r in range(4))
    old, rollout, mask = batches["float64"]
    w, keep, _ = behavior_importance_weights(
        old, rollout, mask, upper=1.2, level="sequence", agg="max"
    )
    opsm, _ = opsm_mask(rollout, old, old - 1, mask, delta=0.01)
    whole = behavior_importance_weights(
        old, rollout, mask, upper=1.1, level="token", action="clamp"
    )[2]
    assert 0 < whole["behave_filtered_fraction"] < 1
    for r in range(4):
        for k in whole:
            torch.testing.assert_close(res[r]["behave"][k], whole[k])
    for ranks in ([0, 1], [2, 3]):
        assert torch.equal(torch.cat([res[r]["cp"][1] for r in ranks], 1), keep)
        torch.testing.assert_close(torch.cat([res[r]["cp"][0] for r in ranks], 1), w)
        assert torch.equal(torch.cat([res[r]["cp"][2] for r in ranks], 1), opsm)


# --------------------------------------------------------------------------- bad input
B, T = 3, 5


def tensors():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(B, T, generator=g) - 0.1
    old = -torch.rand(B, T, generator=g) - 0.1
    return logp, old, torch.randn(B, T, generator=g), torch.ones(B, T)


def opsm(**kw):
    logp, old, adv, mask = tensors()
    return opsm_mask(logp, old, adv, mask, **kw)


def m2po(**kw):
    logp, old, _, mask = tensors()
    return m2po_mask(old, logp, mask, **{"threshold": 1.0, **kw})


def top_entropy(**kw):
    return top_entropy_mask(torch.rand(B, T), torch.ones(B, T), **{"rho": 0.5, **kw})


def behaviour(**kw):
    logp, old, _, mask = tensors()
    return behavior_importance_weights(old, logp, mask, **{"upper": 2.0, **kw})


CALLS = {
    "opsm_mask": opsm,
    "m2po_mask": m2po,
    "top_entropy_mask": top_entropy,
    "behavior_importance_weights": behaviour,
}
REAL, ONE_OF, GROUP = "real number", "must be one of", "ProcessGroup or None"
# (function, keyword, bad value, exception, words of what it accepts)
BAD = [
    ("opsm_mask", "delta", math.nan, ValueError, "a number"),
    ("opsm_mask", "delta", "x", TypeError, REAL),
    ("opsm_mask", "delta", None, TypeError, REAL),
    ("opsm_mask", "delta", torch.ones(2), TypeError, "1-dim tensor"),
    ("opsm_mask", "cp_group", 3, TypeError, GROUP),
    ("m2po_mask", "threshold", math.nan, ValueError, "> 0"),
    ("m2po_mask", "threshold", 0.0, ValueError, "> 0"),
    ("m2po_mask", "threshold", -1.0, ValueError, "> 0"),
    ("m2po_mask", "threshold", "x", TypeError, REAL),
    ("m2po_mask", "threshold", None, TypeError, REAL),
    ("m2po_mask", "group", "world", TypeError, GROUP),
    ("top_entropy_mask", "rho", math.nan, ValueError, ">= 0"),
    ("top_entropy_mask", "rho", math.inf, ValueError, "finite"),
    ("top_entropy_mask", "rho", -0.1, ValueError, ">= 0"),
    ("top_entropy_mask", "rho", 1.5, ValueError, "[0, 1]"),
    ("top_entropy_mask", "rho", "x", TypeError, REAL),
    ("top_entropy_mask", "rho", True, TypeError, REAL),
    ("top_entropy_mask", "group", 3, TypeError, GROUP),
    ("behavior_importance_weights", "upper", math.nan, ValueError, "> 0"),
    ("behavior_importance_weights", "upper", 0.0, ValueError, "> 0"),
    ("behavior_importance_weights", "upper", "x", TypeError, REAL),
    ("behavior_importance_weights", "lower", 3.0, ValueError, "<= upper"),
    ("behavior_importance_weights", "lower", -1.0, ValueError, "> 0"),
    ("behavior_importance_weights", "lower", math.nan, ValueError, "> 0"),
    ("behavior_importance_weights", "lower", "x", TypeError, REAL),
    ("behavior_importance_weights", "level", "seq", ValueError, "'token', 'sequence'"),
    ("behavior_importance_weights", "level", None, ValueError, ONE_OF),
    ("behavior_importance_weights", "agg", "median", ValueError, "'sum', 'mean', 'max'"),
    ("behavior_importance_weights", "agg", 1, ValueError, ONE_OF),
    ("behavior_importance_weights", "action", "drop", ValueError, "'mask', 'clamp'"),
    ("behavior_importance_weights", "group", "x", TypeError, GROUP),
    ("behavior_importance_weights", "cp_group", "x", TypeError, GROUP),
]


@pytest.mark.parametrize(
    ("fn", "kw", "bad", "exc", "words"),
    BAD,
    ids=[f"{f}-{k}-{i}" for i, (f, k, *_) in enumerate(BAD)],
)
def test_bad_keyword_raises_naming_it(fn, kw, bad, exc, words):
    with pytest.raises(exc, match=names(kw)) as info:
        CALLS[fn](**{kw: bad})
    assert words in str(info.value)


FLOAT = "floating-point"
# (function, positional name, index in the call, bad tensor, exception, words)
TENSOR_ARGS = {
    "opsm_mask": ("logp", "old_logp", "advantages", "mask"),
    "m2po_mask": ("old_logp", "rollout_logp", "mask"),
    "behavior_importance_weights": ("old_logp", "rollout_logp", "mask"),
    "top_entropy_mask": ("entropy", "mask"),
}
BAD_TENSORS = [
    (lambda x: x.long(), TypeError, FLOAT, False),
    (lambda x: x.bool(), TypeError, FLOAT, False),
    (lambda x: x.to(torch.complex64), TypeError, "", True),
    (lambda x: x[:, :-1], ValueError, "[3, 5]", True),
    (lambda x: x[None], ValueError, "[", True),
    (lambda x: x.tolist(), TypeError, "torch.Tensor", True),
    (lambda x: x * 0.5, ValueError, "only 0 and 1", "mask only"),
]


def _cases():
    for fn, args in TENSOR_ARGS.items():
        for name in args:
            for i, (bad, exc, words, for_mask) in enumerate(BAD_TENSORS):
                if name == "mask" and for_mask is False:
                    continue  # an integer or bool mask is valid
                if name != "mask" and for_mask == "mask only":
                    continue
                yield pytest.param(fn, name, bad, exc, words, id=f"{fn}-{name}-{i}")


@pytest.mark.parametrize(("fn", "name", "bad", "exc", "words"), list(_cases()))
def test_bad_tensor_raises_naming_it(fn, name, bad, exc, words):
    logp, old, adv, mask = tensors()
    values = {
        "logp": logp,
        "old_logp": old,
        "advantages": adv,
        "mask": mask,
        "rollout_logp": logp,
        "entropy": torch.rand(B, T),
    }
    args = [values[a] for a in TENSOR_ARGS[fn]]
    i = TENSOR_ARGS[fn].index(name)
    args[i] = bad(args[i])
    extra = {
        "opsm_mask": {},
        "m2po_mask": {"threshold": 1.0},
        "top_entropy_mask": {"rho": 0.5},
        "behavior_importance_weights": {"upper": 2.0},
    }[fn]
    call = {
        "opsm_mask": opsm_mask,
        "m2po_mask": m2po_mask,
        "top_entropy_mask": top_entropy_mask,
        "behavior_importance_weights": behavior_importance_weights,
    }[fn]
    with pytest.raises(exc, match=names(name)) as info:
        call(*args, **extra)
    assert words in str(info.value)


def test_valid_values_run():
    # the keywords' valid values run: the bad-value tests are not vacuous
    assert opsm(delta=-math.inf)[0].dtype == torch.bool  # a KL estimate may be negative
    assert m2po(threshold=math.inf)[0].all()
    assert top_entropy(rho=1.0)[0].all()
    w, keep, _ = behaviour(lower=0.5, level="sequence", agg="max", action="clamp")
    assert torch.isfinite(w).all() and keep.dtype == torch.bool
