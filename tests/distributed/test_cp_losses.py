"""Losses and rollout correction with ``cp_group=`` (rows split over context-parallel ranks)
and packed rows (``seq_ids=``).

Definition of "exact under context parallelism": the one-process call on the unsharded rows.
The ranks' losses must sum to it, each rank's gradient must equal its gradient on the rank's
tokens, and the metrics must be the whole rows'. Real Gloo groups of 2 and 4 ranks, both
layouts (zigzag, contiguous), every kind × every aggregation mode, with and without a
data-parallel ``group=`` (DP×CP), packed rows, and a rank whose shard holds no action token;
the collectives of every call are counted. The rollout-correction functions (sequence and
geometric weights, row rejection, row metrics) are checked the same way. Packed rows are
checked against the same sequences as separate rows. The kinds with options of their own
(luspo, vespo, dppo_tv, dppo_kl, dro, sequence levels, gspo's dual clip) run in the same spawn.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed
from tests.tolerances import assert_within_reference

import rlops
from rlops.distributed import zigzag_indices
from rlops.losses import AGG_MODES, POLICY_KINDS

# the kinds of this table (luspo, vespo, dppo_*, dro, the sequence levels and gspo's dual clip:
# KIND_CASES below)
EXACT_KINDS = ("ppo", "reinforce", "gpg", "gspo", "cispo", "sapo", "geo_mean")
assert set(EXACT_KINDS) <= set(POLICY_KINDS)
ROW_KINDS = ("gspo", "geo_mean")  # the kinds with a per-row ratio
OPTIONS = {
    "ppo": {"dual_clip": 3.0},
    "gspo": {"clip_low": 0.05, "clip_high": 0.08},
    "cispo": {"clip_low": 0.1, "clip_high": 0.15},
    "geo_mean": {"clip_low": 0.2},
}
AGGS = (*AGG_MODES, None)
L_NORM = 40.0  # loss_scale_factor of seq-mean-token-sum-norm (required under cp_group)
B, T, K = 3, 23, 3  # rows, whole length (not a multiple of 2·cp: padded), packed slots


# --------------------------------------------------------------------------- data and layout
def _positions(layout: str, t_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions of the whole row (padded to a multiple of 2·cp) that ``rank`` holds."""
    if layout == "zigzag":
        return zigzag_indices(t_len, cp_size=cp, cp_rank=rank)
    padded = -(-t_len // (2 * cp)) * (2 * cp)
    chunk = padded // cp
    return torch.arange(rank * chunk, (rank + 1) * chunk)


def _shard(x: torch.Tensor, layout: str, cp: int, rank: int) -> torch.Tensor:
    pos = _positions(layout, x.shape[-1], cp, rank)
    pad = int(pos.max()) + 1 - x.shape[-1]
    if pad > 0:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], -1)
    return x[..., pos]


def _data(seed: int, empty_rank0: int = 0):
    """``[B, T]`` float64 inputs, a multi-turn mask with an empty row, packed ids. With
    ``empty_rank0=cp`` the mask is 0 on every position rank 0 holds in either layout."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.05
    old = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.08
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv[0] = adv[0, :1]  # one advantage per row on row 0, per token elsewhere
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 9:12] = False  # an interior tool span
    mask[2] = False  # a row with no action token
    if empty_rank0:
        cp = empty_rank0
        for layout in ("zigzag", "contiguous"):
            pos = _positions(layout, T, cp, 0)
            mask[:, pos[pos < T]] = False
    dones = torch.rand(B, T, generator=g) > 0.8
    ids = (dones.long().cumsum(-1) - dones.long()).clamp_max(K - 1)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    returns = torch.randn(B, T, generator=g, dtype=torch.float64)
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    isw = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5
    return dict(
        logp=logp,
        old=old,
        adv=adv,
        mask=mask,
        ids=ids,
        values=values,
        old_values=values + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
        returns=returns,
        entropy=entropy,
        isw=isw,
    )


# --------------------------------------------------------------------------- the calls
def _call(fn: str, d: dict, kind: str | None, agg, grad_of: torch.Tensor, *, options=None, **kw):
    """One loss call; returns (loss, metrics). ``options``: the kind's (default ``OPTIONS``)."""
    if agg == "seq-mean-token-sum-norm":
        kw["loss_scale_factor"] = L_NORM
    packed = kw.pop("packed")
    if packed:
        kw.update(seq_ids=d["ids"], seqs_per_row=K)
    if fn == "policy_loss":
        return rlops.policy_loss(
            grad_of,
            d["old"],
            d["adv"],
            d["mask"],
            kind=kind,
            agg=agg,
            rollout_is_weights=d["isw"],
            **(OPTIONS.get(kind, {}) if options is None else options),
            **kw,
        )
    if fn == "value_loss":
        return rlops.value_loss(
            grad_of, d["old_values"], d["returns"], d["mask"], clip=0.2, agg=agg, **kw
        )
    if fn == "entropy_loss":
        return rlops.entropy_loss(grad_of, d["mask"], agg=agg, coef=0.01, **kw)
    return rlops.aggregate_loss(grad_of, d["mask"], agg, **kw), {}


def _cases(full: bool = True):
    """Every function × kind × aggregation mode × layout × packed or not; not ``full``: every
    kind × mode × layout of policy_loss, one layout of the others, nothing packed."""
    for fn, kinds, aggs in (
        ("policy_loss", EXACT_KINDS, AGGS),
        ("value_loss", (None,), AGGS),
        ("entropy_loss", (None,), AGG_MODES),
        ("aggregate_loss", (None,), AGG_MODES),
    ):
        for kind in kinds:
            for agg in aggs:
                for layout in ("zigzag", "contiguous"):
                    for packed in (False, True):
                        if full or not (packed or (fn != "policy_loss" and layout != "zigzag")):
                            yield fn, kind, agg, layout, packed


RS_CRITERIA = (
    {"token_k1": (0.9, 1.1), "seq_mean_k3": 0.003, "seq_max_k2": 0.01, "seq_sum_k1": (0.5, 2.0)},
    {"seq_mean_k3": 0.003},
    {"seq_sum_k1": (0.7, 1.5)},
)
IS_ARGS = (
    dict(level="sequence", mode="mask", threshold=1.5, low=0.5, batch_normalize=True),
    dict(level="geometric", threshold=1.02, low=0.98),
    dict(level="token", threshold=1.1),
)


def _rollout_cases(full: bool = True):
    for fn, args in (
        ("rollout_importance_weights", IS_ARGS),
        ("rollout_rejection_mask", RS_CRITERIA),
        ("rollout_mismatch_metrics", ({},)),
    ):
        for i in range(len(args)):
            for layout in ("zigzag", "contiguous"):
                for packed in (False, True) if full else (False,):
                    yield fn, i, layout, packed


def _rollout_call(fn: str, i: int, d: dict, packed: bool, **kw):
    """(token tensors, metrics) of one rollout-correction call (d = old − rollout)."""
    if packed:
        kw.update(seq_ids=d["ids"], seqs_per_row=K)
    if fn == "rollout_importance_weights":
        w, keep, m = rlops.rollout_importance_weights(
            d["old"], d["logp"], d["mask"], **IS_ARGS[i], **kw
        )
        return [w, keep], m
    if fn == "rollout_rejection_mask":
        keep, m = rlops.rollout_rejection_mask(d["old"], d["logp"], d["mask"], RS_CRITERIA[i], **kw)
        return [keep], m
    return [], rlops.rollout_mismatch_metrics(d["old"], d["logp"], d["mask"], **kw)


def _live(fn: str) -> str:
    return {
        "policy_loss": "logp",
        "value_loss": "values",
        "entropy_loss": "entropy",
        "aggregate_loss": "logp",
    }[fn]


def _expected_calls(fn: str, kind, agg, dp: bool, check: bool, counts: bool = False) -> int:
    """all_gather calls per call, from the documented table (every payload here fits the
    first exchange, so a checked collective is one all_gather). ``counts``: num_tokens and
    num_seqs given."""
    metrics = fn in ("policy_loss", "value_loss")
    row_kind = kind in ROW_KINDS
    seq = agg is not None and agg.startswith("seq")
    if not dp:  # cp_group only
        if row_kind:
            return 2  # the row summaries, then the metrics
        needs = agg == "seq-mean-token-mean" or (not counts and agg not in (None, "token-sum"))
        return 1 if metrics or needs or check else 0
    if check:
        return 2  # the row counts over cp_group (the check's first exchange), then group
    rows = 1 if row_kind or seq else 0
    totals = 1 if metrics or (agg is not None and agg != "token-sum") else 0
    return rows + totals


def _cases_on_ranks(rank: int, configs: list[tuple], full: bool = True) -> list[dict]:
    """For each ``(cp, dp, seed, with group, empty rank 0)`` config and case: this rank's loss,
    gradient, metrics and collective counts, and the one-process values on the whole rows
    (every rank holds the whole data and computes them too: no collective)."""
    out = []
    for cp, dp, seed, with_group, empty, *given in configs:
        # groups: CP ranks are consecutive; the DP×CP group is the whole world
        cp_groups = [dist.new_group(list(range(i * cp, (i + 1) * cp))) for i in range(dp)]
        replica, cp_rank = divmod(rank, cp)
        cp_group = cp_groups[replica]
        group = dist.group.WORLD if with_group else None
        datas = [_data(seed * 10 + i, empty_rank0=cp if empty else 0) for i in range(dp)]
        whole = {k: torch.cat([x[k] for x in datas]) for k in datas[0]}
        mine = datas[replica]
        for check in (True, False) if full else (True,):
            os.environ["RLOPS_GROUP_CHECK"] = "1" if check else "0"
            for fn, kind, agg, layout, packed in _cases(full):
                if not check and (packed or layout == "contiguous"):
                    continue  # the counts without the check: one pass is enough
                name = _live(fn)
                local = {k: _shard(v, layout, cp, cp_rank) for k, v in mine.items()}
                x = local[name].clone().requires_grad_(True)
                counts = {}
                if given:  # the whole batch's counts instead of a group (rows or sequences)
                    seqs = (
                        (
                            torch.stack([whole["ids"] == k for k in range(K)], 1)
                            & whole["mask"][:, None]
                        ).any(-1)
                        if packed
                        else whole["mask"].any(-1)
                    )
                    counts = {
                        "num_tokens": float(whole["mask"].sum()),
                        "num_seqs": float(seqs.sum()),
                    }
                with count_collectives() as calls:
                    loss, metrics = _call(
                        fn,
                        local,
                        kind,
                        agg,
                        x,
                        packed=packed,
                        cp_group=cp_group,
                        cp_layout=layout,
                        group=group,
                        **counts,
                    )
                (loss if agg is not None else (loss * local["adv"]).sum()).backward()
                xw = whole[name].clone().requires_grad_(True)
                wl, wm = _call(fn, whole, kind, agg, xw, packed=packed)
                (wl if agg is not None else (wl * whole["adv"]).sum()).backward()
                rows = slice(replica * B, (replica + 1) * B)
                out.append(
                    dict(
                        case=(cp, dp, seed, check, fn, kind, agg, layout, packed),
                        loss=loss.detach(),
                        grad=x.grad,
                        metrics=metrics,
                        calls=dict(calls),
                        want_loss=wl.detach(),
                        want_metrics=wm,
                        want_grad=_shard(xw.grad[rows], layout, cp, cp_rank),
                        want_matrix=(
                            _shard(wl.detach()[rows], layout, cp, cp_rank) if agg is None else None
                        ),
                        expected_calls=_expected_calls(
                            fn, kind, agg, with_group, check, bool(given)
                        ),
                    )
                )
        os.environ["RLOPS_GROUP_CHECK"] = "1"
        rows = slice(replica * B, (replica + 1) * B)
        for fn, i, layout, packed in _rollout_cases(full):
            local = {k: _shard(v, layout, cp, cp_rank) for k, v in mine.items()}
            with count_collectives() as calls:
                got, metrics = _rollout_call(
                    fn, i, local, packed, cp_group=cp_group, cp_layout=layout, group=group
                )
            want, wm = _rollout_call(fn, i, whole, packed)
            out.append(
                dict(
                    case=(cp, dp, seed, fn, i, layout, packed),
                    tensors=got,
                    metrics=metrics,
                    want_tensors=[_shard(w[rows], layout, cp, cp_rank) for w in want],
                    want_metrics=wm,
                    calls=dict(calls),
                    expected_calls=2,  # rows, then metrics
                )
            )
    os.environ["RLOPS_GROUP_CHECK"] = "1"
    return out


DTYPE_KINDS = ("ppo", "gspo", "geo_mean", "sapo")
DTYPE_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _dtype_work(rank: int, world: int) -> list[dict]:
    """float32 and bfloat16 inputs on 2 CP ranks: each rank's loss share and gradient, with the
    one-process results in that dtype and in float64 (the oracle) on the whole rows."""
    g = dist.group.WORLD
    d64 = _data(21, empty_rank0=world)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        d = {k: v.to(dtype) if v.is_floating_point() else v for k, v in d64.items()}
        for kind in DTYPE_KINDS:
            for agg in DTYPE_AGGS:
                for layout in ("zigzag", "contiguous"):
                    local = {k: _shard(v, layout, world, rank) for k, v in d.items()}
                    res = {}
                    for name, data, kw in (
                        ("cp", local, {"cp_group": g, "cp_layout": layout}),
                        ("same", d, {}),
                        ("f64", d64, {}),
                    ):
                        x = data["logp"].clone().requires_grad_(True)
                        loss, _ = _call("policy_loss", data, kind, agg, x, packed=False, **kw)
                        loss.backward()
                        grad = x.grad if name == "cp" else _shard(x.grad, layout, world, rank)
                        res[name] = (loss.detach(), grad.to(loss.dtype))
                    out.append({"case": (dtype, kind, agg, layout), **res})
    return out


def _two_ranks(rank: int, world: int) -> dict:
    """Everything that runs on 2 ranks, in one spawn."""
    cases = _cases_on_ranks(rank, [(2, 1, 0, True, False), (2, 1, 1, False, True)])
    given = _cases_on_ranks(rank, [(2, 1, 4, False, True, "counts")], full=False)
    return {
        "cases": cases + given,
        "bad": _bad_work(rank, world),
        "hand": _hand_work(rank, world),
        "dtypes": _dtype_work(rank, world),
        "kinds": _kinds_work(rank, world),  # last: it switches the group check on
    }


def _four_ranks(rank: int, world: int) -> dict:
    return {
        "cases": _cases_on_ranks(rank, [(4, 1, 1, False, True), (2, 2, 2, True, True)], full=False)
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_distributed(_two_ranks, 2, timeout=480)


def _close(a: torch.Tensor, b: torch.Tensor, msg) -> None:
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13, msg=lambda m: f"{msg}: {m}")


def _verify(results: list[list[dict]]) -> int:
    n = 0
    for i in range(len(results[0])):
        per_rank = [r[i] for r in results]
        case = per_rank[0]["case"]
        if "tensors" in per_rank[0]:  # rollout correction: tensors and metrics as they are
            for r in per_rank:
                assert r["calls"] == {"all_gather": r["expected_calls"]}, (case, r["calls"])
                for a, b in zip(r["tensors"], r["want_tensors"], strict=True):
                    _close(a, b, case)
                for k, v in r["want_metrics"].items():
                    _close(r["metrics"][k], v, (case, k))
            n += 1
            continue
        fn, agg = case[4], case[6]
        for r in per_rank:
            assert r["case"] == case
            assert r["calls"] == (
                {"all_gather": r["expected_calls"]} if r["expected_calls"] else {}
            ), (case, r["calls"])
            _close(r["grad"], r["want_grad"], case)
            if agg is None:
                _close(r["loss"], r["want_matrix"], case)
        if agg is not None:
            total = sum(r["loss"] for r in per_rank)
            _close(total, per_rank[0]["want_loss"], case)
        for r in per_rank:
            for k, v in r["want_metrics"].items():
                got = r["metrics"][k]
                if fn == "entropy_loss":  # a share, like the loss
                    got = sum(q["metrics"][k] for q in per_rank)
                _close(got, v, (case, k))
        n += 1
    return n


@pytest.mark.distributed
def test_losses_on_two_cp_ranks_sum_to_the_whole_rows(two_ranks):
    """Every kind × aggregation mode × layout (packed or not; group= or not; an empty rank):
    loss sum over the ranks, gradient on each rank's tokens and metrics equal the one-process
    call on the whole rows; the collectives per call match the documented table."""
    assert _verify([r["cases"] for r in two_ranks]) == 580 + 2 * 28 + 100 + 14


@pytest.mark.distributed
@pytest.mark.slow
def test_losses_on_four_ranks_cp4_and_dp2_cp2():
    """4 ranks, as one CP group of 4 and as DP 2 × CP 2 (group= the world): every kind ×
    aggregation mode × layout of policy_loss and the other functions on one layout."""
    results = run_distributed(_four_ranks, 4, timeout=240)
    assert _verify([r["cases"] for r in results]) == 2 * (84 + 16 + 14)


@pytest.mark.distributed
def test_float32_and_bfloat16_shares_as_accurate_as_one_process(two_ranks):
    """Against float64 on the whole rows, the summed CP shares and each rank's gradient are
    within twice the error of the one-process call in the same dtype (half inputs compute in
    float32: both outputs are float32), plus a few ulps."""
    r0, r1 = (r["dtypes"] for r in two_ranks)
    assert len(r0) == 2 * len(DTYPE_KINDS) * len(DTYPE_AGGS) * 2
    for a, b in zip(r0, r1, strict=True):
        (l0, g0), (l1, g1) = a["cp"], b["cp"]
        total = (l0.double() + l1.double()).to(l0.dtype)
        assert_within_reference(str(a["case"]), total, a["f64"][0], a["same"][0])
        for r, grad in ((a, g0), (b, g1)):
            assert_within_reference(str(r["case"]), grad, r["f64"][1], r["same"][1])


# --------------------------------------------------------------------------- kinds with options
KIND_CASES = {
    "gspo_dual": ("gspo", {"clip_low": 0.01, "clip_high": 0.02, "dual_clip": 1.005}),
    "cispo_seq": ("cispo", {"clip_low": 0.01, "clip_high": 0.015, "level": "sequence"}),
    "sapo_seq": ("sapo", {"level": "sequence"}),
    "luspo": ("luspo", {"clip_low": 0.01, "clip_high": 0.02}),
    "vespo": ("vespo", {}),
    "dppo_tv": ("dppo_tv", {"clip_low": 0.02, "clip_high": 0.03, "clip_ratio_c": 1.05}),
    "dppo_kl": ("dppo_kl", {"clip_low": 2e-3, "clip_high": 3e-3, "clip_ratio_c": 1.05}),
    "dro": ("dro", {"dro_beta": 0.5}),
}
KIND_ROW_CASES = ("gspo_dual", "cispo_seq", "sapo_seq", "luspo", "vespo")  # a per-row quantity


def _kind_data(seed, empty=False):
    """The rows of :func:`_data` with the log-ratios mirrored (sequence ratios
    above 1: the dual clip binds) and π_old < 1 (DPPO reads it as a probability)."""
    d = _data(seed, empty_rank0=2 if empty else 0)
    d["old"] = (2 * d["logp"] - d["old"]).clamp_max(-0.01)
    return d


def _kind_call(case, d, agg, x, packed, **kw):
    kind, opts = KIND_CASES[case]
    return _call("policy_loss", d, kind, agg, x, packed=packed, options=opts, **kw)


def _kind_expected_calls(case, agg, with_group):
    """all_gather calls per call (the group check on): the documented table."""
    if with_group:
        return 2  # the row counts over cp_group (the check's first exchange), then group
    return 2 if case in KIND_ROW_CASES else 1  # the row summaries, then the metrics


def _kinds_work(rank, world):
    os.environ["RLOPS_GROUP_CHECK"] = "1"
    cp_group = dist.new_group([0, 1])
    out = []
    for seed, with_group, empty in ((0, False, False), (1, True, True)):
        whole = _kind_data(seed, empty)
        group = dist.group.WORLD if with_group else None
        for case in KIND_CASES:
            for agg in AGGS:
                for layout in ("zigzag", "contiguous"):
                    for packed in (False, True):
                        local = {k: _shard(v, layout, 2, rank) for k, v in whole.items()}
                        x = local["logp"].clone().requires_grad_(True)
                        with count_collectives() as calls:
                            loss, metrics = _kind_call(
                                case,
                                local,
                                agg,
                                x,
                                packed,
                                cp_group=cp_group,
                                cp_layout=layout,
                                group=group,
                            )
                        (loss if agg is not None else (loss * local["adv"]).sum()).backward()
                        xw = whole["logp"].clone().requires_grad_(True)
                        wl, wm = _kind_call(case, whole, agg, xw, packed)
                        (wl if agg is not None else (wl * whole["adv"]).sum()).backward()
                        out.append(
                            dict(
                                case=(seed, case, agg, layout, packed),
                                loss=loss.detach(),
                                grad=x.grad,
                                metrics=metrics,
                                calls=dict(calls),
                                want_loss=wl.detach(),
                                want_metrics=wm,
                                want_grad=_shard(xw.grad, layout, 2, rank),
                                want_matrix=(
                                    _shard(wl.detach(), layout, 2, rank) if agg is None else None
                                ),
                                expected=_kind_expected_calls(case, agg, with_group),
                            )
                        )
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("kind_case", KIND_CASES)
def test_kinds_with_options_on_two_cp_ranks_equal_the_whole_rows(two_ranks, kind_case):
    """The sequence levels of cispo and sapo, gspo's dual clip, luspo and vespo (per-row
    quantities), and the per-token dppo_tv, dppo_kl and dro: exact as above, both layouts,
    packed rows, with and without a DP×CP ``group=``, a rank whose shard holds no action token;
    collectives counted."""
    results = [[r for r in ranks["kinds"] if r["case"][1] == kind_case] for ranks in two_ranks]
    n = 0
    for i in range(len(results[0])):
        per_rank = [r[i] for r in results]
        case, agg = per_rank[0]["case"], per_rank[0]["case"][2]
        for r in per_rank:
            assert r["case"] == case
            assert r["calls"] == {"all_gather": r["expected"]}, (case, r["calls"])
            _close(r["grad"], r["want_grad"], case)
            if agg is None:
                _close(r["loss"], r["want_matrix"], case)
            for k, v in r["want_metrics"].items():
                _close(r["metrics"][k], v, (case, k))
        if agg is not None:
            _close(sum(r["loss"] for r in per_rank), per_rank[0]["want_loss"], case)
        n += 1
    assert n == 2 * len(AGGS) * 2 * 2 == 48
    assert len(two_ranks[0]["kinds"]) == len(KIND_CASES) * n == 384
    assert B == 3


def test_the_kind_data_exercise_the_branches():
    """The one-process calls above clip, dual-clip and drop tokens somewhere."""
    d = _kind_data(0)
    for case, key in (
        ("gspo_dual", "pg_clipfrac_lower"),
        ("cispo_seq", "pg_clipfrac"),
        ("dppo_tv", "pg_clipfrac"),
        ("dppo_kl", "pg_clipfrac"),
        ("dppo_tv", "pg_clipfrac_lower"),
    ):
        _, m = _kind_call(case, d, "token-mean", d["logp"], False)
        assert 0 < m[key] < 1, (case, key)


# --------------------------------------------------------------------------- bad input, mismatch
def _bad_work(rank: int, world: int):
    g = dist.group.WORLD
    d = _data(5)
    local = {k: _shard(v, "zigzag", world, rank) for k, v in d.items()}
    errors = {}

    def attempt(name, thunk):
        try:
            thunk()
        except (ValueError, TypeError) as e:
            errors[name] = str(e)
        else:
            errors[name] = None

    for kind in ("clip_cov", "kl_cov"):
        attempt(
            kind,
            lambda kind=kind: rlops.policy_loss(
                local["logp"], local["old"], local["adv"], local["mask"], kind=kind, cp_group=g
            ),
        )
    attempt(
        "norm without L",
        lambda: rlops.aggregate_loss(
            local["logp"], local["mask"], "seq-mean-token-sum-norm", cp_group=g
        ),
    )
    odd = dist.new_group([0]) if world > 1 else None
    # a group that does not hold cp_group's other ranks (rank 1 is not even in it): each rank
    # raises, and fails its cp_group together with the other
    attempt(
        "group without cp_group",
        lambda: rlops.aggregate_loss(local["logp"], local["mask"], group=odd, cp_group=g),
    )
    # mismatched calls over cp_group: the same error on every rank, no hang
    attempt(
        "kind",
        lambda: rlops.policy_loss(
            local["logp"],
            local["old"],
            local["adv"],
            local["mask"],
            kind="gspo" if rank else "ppo",
            cp_group=g,
        ),
    )
    attempt(
        "layout",
        lambda: rlops.aggregate_loss(
            local["logp"],
            local["mask"],
            "seq-mean-token-mean",
            cp_group=g,
            cp_layout="zigzag" if rank else "contiguous",
        ),
    )
    attempt(
        "packed on one rank",
        lambda: rlops.value_loss(
            local["values"],
            local["values"],
            local["returns"],
            local["mask"],
            cp_group=g,
            **({"seq_ids": local["ids"], "seqs_per_row": K} if rank else {}),
        ),
    )
    # still in step afterwards
    x = local["logp"]
    errors["after"] = rlops.aggregate_loss(x, local["mask"], "seq-mean-token-mean", cp_group=g)
    return errors


@pytest.mark.distributed
def test_inexact_kinds_and_modes_raise_and_mismatches_raise_everywhere(two_ranks):
    ranks = [r["bad"] for r in two_ranks]
    for r in ranks:
        for kind in ("clip_cov", "kl_cov"):
            assert "cannot be exact with cp_group" in r[kind], r[kind]
        assert "needs loss_scale_factor" in r["norm without L"]
    assert (
        "must be the data-parallel × context-parallel group" in ranks[0]["group without cp_group"]
    )
    assert ranks[1]["group without cp_group"] is not None
    for name, field in (
        ("kind", "`kind`: ['ppo', 'gspo']"),
        ("layout", "`cp_layout`: ['contiguous', 'zigzag']"),
        ("packed on one rank", "`seqs_per_row`: [<absent>, 3]"),
    ):
        assert ranks[0][name] == ranks[1][name], name
        assert ranks[0][name] is not None and field in ranks[0][name], (name, ranks[0][name])
    d = _data(5)
    want = rlops.aggregate_loss(d["logp"], d["mask"], "seq-mean-token-mean")
    _close(ranks[0]["after"] + ranks[1]["after"], want, "after")


# --------------------------------------------------------------------------- by hand
def _hand_work(rank: int, world: int):
    g = dist.group.WORLD
    # one row [lr 0.1, 0.3 | 0.2, (off)] split contiguously: rank 0 the first two tokens
    lr = [[0.1, 0.3], [0.2, 0.0]][rank]
    mask = torch.tensor([[1, 1], [1, 0]][rank])[None]
    logp = torch.tensor([lr], dtype=torch.float64, requires_grad=True)
    loss, m = rlops.policy_loss(
        logp,
        torch.zeros(1, 2, dtype=torch.float64),
        torch.ones(1, 2, dtype=torch.float64),
        mask,
        kind="gspo",
        clip_low=0.5,
        clip_high=0.5,
        cp_group=g,
        cp_layout="contiguous",
    )
    loss.backward()
    agg = rlops.aggregate_loss(
        torch.tensor([[1.0, 2.0], [3.0, 4.0]][rank])[None],
        mask,
        "seq-mean-token-mean",
        cp_group=g,
        cp_layout="contiguous",
    )
    return loss.detach(), logp.grad, m["seq_ratio_mean"], agg


@pytest.mark.distributed
def test_hand_computed_two_ranks(two_ranks):
    """gspo, A = 1, no clip: s = exp(mean(0.1, 0.3, 0.2)) = e^0.2, token-mean over N = 3:
    rank 0's share −2s/3, rank 1's −s/3, gradient −s/3 per action token. seq-mean-token-mean
    of [1, 2 | 3, (4 off)]: (1 + 2 + 3)/3 = 2, shares 1 and 1."""
    s = math.exp(0.2)
    (l0, g0, m0, a0), (l1, g1, m1, a1) = (r["hand"] for r in two_ranks)
    _close(l0, torch.tensor(-2 * s / 3, dtype=torch.float64), "rank 0")
    _close(l1, torch.tensor(-s / 3, dtype=torch.float64), "rank 1")
    _close(g0, torch.full((1, 2), -s / 3, dtype=torch.float64), "grad 0")
    _close(g1, torch.tensor([[-s / 3, 0.0]], dtype=torch.float64), "grad 1")
    for m in (m0, m1):
        _close(m, torch.tensor(s, dtype=torch.float64), "seq_ratio_mean")
    assert a0.item() == 1.0 and a1.item() == 1.0


# --------------------------------------------------------------------------- packed rows
def _unpack(d: dict) -> tuple[dict, torch.Tensor]:
    """Each (row, sequence) of the packed batch as its own row (tokens of other sequences
    masked out), so per-row quantities of the unpacked batch are per-sequence ones."""
    sel = torch.stack([d["ids"] == k for k in range(K)], 1).reshape(B * K, T)
    out = {k: v.repeat_interleave(K, 0) for k, v in d.items()}
    out["mask"] = out["mask"] & sel
    return out, sel


@pytest.mark.parametrize("kind", EXACT_KINDS)
def test_packed_rows_equal_the_sequences_as_rows(kind):
    d = _data(11)
    unpacked, _ = _unpack(d)
    for agg in AGGS:
        kw = {"loss_scale_factor": L_NORM} if agg == "seq-mean-token-sum-norm" else {}
        x = d["logp"].clone().requires_grad_(True)
        loss, m = rlops.policy_loss(
            x,
            d["old"],
            d["adv"],
            d["mask"],
            kind=kind,
            agg=agg,
            seq_ids=d["ids"],
            seqs_per_row=K,
            **OPTIONS.get(kind, {}),
            **kw,
        )
        xu = unpacked["logp"].clone().requires_grad_(True)
        lu, mu = rlops.policy_loss(
            xu,
            unpacked["old"],
            unpacked["adv"],
            unpacked["mask"],
            kind=kind,
            agg=agg,
            **OPTIONS.get(kind, {}),
            **kw,
        )
        if agg is None:  # each token's loss is in exactly one of the K copies of its row
            lu = lu.reshape(B, K, T).sum(1)
            loss.sum().backward()
            lu.sum().backward()
        else:
            loss.backward()
            lu.backward()
        _close(loss.detach(), lu.detach(), (kind, agg))
        _close(x.grad, xu.grad.reshape(B, K, T).sum(1), (kind, agg, "grad"))
        for k in mu:
            _close(m[k], mu[k], (kind, agg, k))


def test_packed_aggregation_by_hand_and_bad_ids():
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    ids = torch.tensor([[0, 0, 1, 1]])
    # sequences [1, 2] and [3]: token sums 3 and 3, means 1.5 and 3
    want = {"seq-mean-token-sum": 3.0, "seq-mean-token-mean": 2.25, "token-mean": 2.0}
    for mode, v in want.items():
        assert rlops.aggregate_loss(loss, mask, mode, seq_ids=ids, seqs_per_row=2).item() == v
    # an empty slot (K = 3) is not a sequence
    assert (
        rlops.aggregate_loss(loss, mask, "seq-mean-token-mean", seq_ids=ids, seqs_per_row=3).item()
        == 2.25
    )
    with pytest.raises(ValueError, match="seq_ids needs seqs_per_row"):
        rlops.aggregate_loss(loss, mask, seq_ids=ids)
    with pytest.raises(ValueError, match="seqs_per_row is given without seq_ids"):
        rlops.aggregate_loss(loss, mask, seqs_per_row=2)
    with pytest.raises(TypeError, match="seq_ids must be an integer tensor"):
        rlops.aggregate_loss(loss, mask, seq_ids=ids.double(), seqs_per_row=2)
    with pytest.raises(ValueError, match="seq_ids must have shape"):
        rlops.aggregate_loss(loss, mask, seq_ids=ids[:, :3], seqs_per_row=2)
    with pytest.raises(
        ValueError,
        match=r"must lie in \[0, seqs_per_row\) = \[0, 2\), "
        r"got values in \[1, 2\]",
    ):
        rlops.aggregate_loss(loss, mask, seq_ids=ids + 1, seqs_per_row=2)
    with pytest.raises(ValueError, match="seqs_per_row must be >= 1"):
        rlops.aggregate_loss(loss, mask, seq_ids=ids, seqs_per_row=0)
    with pytest.raises(TypeError, match="seqs_per_row must be an int"):
        rlops.aggregate_loss(loss, mask, seq_ids=ids, seqs_per_row=2.0)
    with pytest.raises(ValueError, match="cp_layout must be one of"):
        rlops.value_loss(loss, loss, loss, mask, cp_layout="ring")
    with pytest.raises(TypeError, match=r"cp_group must be a torch\.distributed\.ProcessGroup"):
        rlops.entropy_loss(loss, mask, cp_group="world")
    # the id of a mask-0 token is ignored
    odd = ids.clone()
    odd[0, 3] = 99
    assert (
        rlops.aggregate_loss(loss, mask, "seq-mean-token-mean", seq_ids=odd, seqs_per_row=2).item()
        == 2.25
    )


@pytest.mark.parametrize(
    "fn", ["rollout_importance_weights", "rollout_rejection_mask", "rollout_mismatch_metrics"]
)
def test_packed_rollout_correction_equals_the_sequences_as_rows(fn):
    d = _data(12)
    unpacked, _ = _unpack(d)
    n = (
        len(IS_ARGS)
        if fn == "rollout_importance_weights"
        else (len(RS_CRITERIA) if fn == "rollout_rejection_mask" else 1)
    )
    for i in range(n):
        got, m = _rollout_call(fn, i, d, True)
        want, wm = _rollout_call(fn, i, unpacked, False)
        for a, w in zip(got, want, strict=True):  # each token is kept in one copy of its row
            w = w.reshape(B, K, T)
            _close(a, w.any(1) if w.dtype == torch.bool else w.sum(1), (fn, i))
        for k in wm:
            _close(m[k], wm[k], (fn, i, k))
