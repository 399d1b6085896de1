"""The newer policy-loss kinds under ``cp_group=`` on 2 Gloo ranks (one spawn): the sequence
levels of cispo and sapo, gspo's dual clip, luspo and vespo (per-row quantities), and the
per-token dppo_tv, dppo_kl and dro. Exact means as in tests/distributed/test_cp_losses.py: the
ranks' losses sum to the one-process loss on the whole rows, each rank's gradient is the whole rows'
gradient on its tokens, the metrics are the whole rows'; both layouts, packed rows, with and
without a DP×CP ``group=``, a rank whose shard holds no action token; collectives counted."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed
from tests.distributed.test_cp_losses import AGGS, L_NORM, B, K, _close, _data, _shard

import rlops

CASES = {
    "gspo_dual": ("gspo", {"clip_low": 0.01, "clip_high": 0.02, "dual_clip": 1.005}),
    "cispo_seq": ("cispo", {"clip_low": 0.01, "clip_high": 0.015, "level": "sequence"}),
    "sapo_seq": ("sapo", {"level": "sequence"}),
    "luspo": ("luspo", {"clip_low": 0.01, "clip_high": 0.02}),
    "vespo": ("vespo", {}),
    "dppo_tv": ("dppo_tv", {"clip_low": 0.02, "clip_high": 0.03, "clip_ratio_c": 1.05}),
    "dppo_kl": ("dppo_kl", {"clip_low": 2e-3, "clip_high": 3e-3, "clip_ratio_c": 1.05}),
    "dro": ("dro", {"dro_beta": 0.5}),
}
ROW_CASES = ("gspo_dual", "cispo_seq", "sapo_seq", "luspo", "vespo")  # a per-row quantity


def _cp_data(seed, empty=False):
    """tests/distributed/test_cp_losses.py's rows with the log-ratios mirrored (sequence ratios
    above 1: the dual clip binds) and π_old < 1 (DPPO reads it as a probability)."""
    d = _data(seed, empty_rank0=2 if empty else 0)
    d["old"] = (2 * d["logp"] - d["old"]).clamp_max(-0.01)
    return d


def _call(case, d, agg, x, packed, **kw):
    kind, opts = CASES[case]
    if agg == "seq-mean-token-sum-norm":
        kw["loss_scale_factor"] = L_NORM
    if packed:
        kw.update(seq_ids=d["ids"], seqs_per_row=K)
    return rlops.policy_loss(
        x,
        d["old"],
        d["adv"],
        d["mask"],
        kind=kind,
        agg=agg,
        rollout_is_weights=d["isw"],
        **opts,
        **kw,
    )


def _expected_calls(case, agg, with_group):
    """all_gather calls per call (the group check on): the documented table."""
    if with_group:
        return 2  # the row counts over cp_group (the check's first exchange), then group
    return 2 if case in ROW_CASES else 1  # the row summaries, then the metrics


def _work(rank, world):
    os.environ["RLOPS_GROUP_CHECK"] = "1"
    cp_group = dist.new_group([0, 1])
    out = []
    for seed, with_group, empty in ((0, False, False), (1, True, True)):
        whole = _cp_data(seed, empty)
        group = dist.group.WORLD if with_group else None
        for case in CASES:
            for agg in AGGS:
                for layout in ("zigzag", "contiguous"):
                    for packed in (False, True):
                        local = {k: _shard(v, layout, 2, rank) for k, v in whole.items()}
                        x = local["logp"].clone().requires_grad_(True)
                        with count_collectives() as calls:
                            loss, metrics = _call(
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
                        wl, wm = _call(case, whole, agg, xw, packed)
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
                                expected=_expected_calls(case, agg, with_group),
                            )
                        )
    return out


@pytest.mark.distributed
def test_new_kinds_on_two_cp_ranks_equal_the_whole_rows():
    results = run_distributed(_work, 2, timeout=240)
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
    assert n == 2 * len(CASES) * len(AGGS) * 2 * 2 == 384
    assert B == 3


def test_the_cp_data_exercise_the_branches():
    """The one-process calls above clip, dual-clip and drop tokens somewhere."""
    d = _cp_data(0)
    for case, key in (
        ("gspo_dual", "pg_clipfrac_lower"),
        ("cispo_seq", "pg_clipfrac"),
        ("dppo_tv", "pg_clipfrac"),
        ("dppo_kl", "pg_clipfrac"),
        ("dppo_tv", "pg_clipfrac_lower"),
    ):
        _, m = _call(case, d, "token-mean", d["logp"], False)
        assert 0 < m[key] < 1, (case, key)
