"""Every ``group=`` / ``cp_group=`` call checks that its ranks make the same call.

On 2 real Gloo ranks, each mismatch below (ranks that disagree on a mode, a kind, a level, a
threshold, a flag, the criteria, the function itself, or a ``cp_group`` given on one rank
only) raises the same ``ValueError`` on both ranks, naming the argument and each rank's value,
where it used to return a silently wrong result or abort inside Gloo. All cases run one after
the other in the same two processes: after each error the group is still in step (the next
case would hang or abort otherwise).

Collective counts: with ``RLOPS_GROUP_CHECK=0`` each call makes exactly its data collective;
with the check on, the same number where the payload fits the fixed first exchange (the check
rides on it), one more only where the payload's size depends on shapes and exceeds it. The
results are bitwise those of the check off.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed

import rlops
from rlops.distributed import collectives
from rlops.distributed.collectives import SLOTS, Call

F64 = torch.float64


def _batch(rank: int, b: int = 3, t: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 10 * rank)
    logp = -torch.rand(b, t, generator=g, dtype=F64) * 2
    old = logp + 0.1 * torch.randn(b, t, generator=g, dtype=F64)
    rollout = old + 0.1 * torch.randn(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, t, generator=g, dtype=F64)
    mask = torch.rand(b, t, generator=g) < 0.8
    mask[:, 0] = True
    return logp, old, rollout, adv, mask


# --------------------------------------------------------------------------- the mismatches
def _pick(rank, a, b):
    return a if rank == 0 else b


def _agg_mode(rank, g):
    logp, _, _, _, mask = _batch(rank)
    rlops.aggregate_loss(logp, mask, _pick(rank, "token-mean", "seq-mean-token-mean"), group=g)


def _policy_agg(rank, g):
    logp, old, _, adv, mask = _batch(rank)
    rlops.policy_loss(
        logp, old, adv, mask, agg=_pick(rank, "token-mean", "seq-mean-token-sum"), group=g
    )


def _policy_kind(other):
    def case(rank, g):
        logp, old, _, adv, mask = _batch(rank)
        rlops.policy_loss(logp, old, adv, mask, kind=_pick(rank, "ppo", other), group=g)

    return case


def _policy_clip(rank, g):
    logp, old, _, adv, mask = _batch(rank)
    rlops.policy_loss(logp, old, adv, mask, clip_low=_pick(rank, 0.2, 0.25), group=g)


def _norm_length(rank, g):  # seq-mean-token-sum-norm divides by T unless L is given
    logp, old, _, adv, mask = _batch(rank, t=_pick(rank, 5, 6))
    rlops.policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum-norm", group=g)


def _value_clip(rank, g):
    logp, old, _, adv, mask = _batch(rank)
    rlops.value_loss(logp, old, adv, mask, clip=_pick(rank, None, 0.5), group=g)


def _entropy_vs_aggregate(rank, g):
    logp, _, _, _, mask = _batch(rank)
    if rank == 0:
        rlops.entropy_loss(-logp, mask, group=g)
    else:
        rlops.aggregate_loss(-logp, mask, group=g)


def _is(rank, g, **kw):
    _, old, rollout, _, mask = _batch(rank)
    return rlops.rollout_importance_weights(old, rollout, mask, group=g, **kw)


def _is_level(rank, g):
    _is(rank, g, level=_pick(rank, "token", "sequence"))


def _is_batch_normalize(rank, g):
    _is(rank, g, batch_normalize=rank == 0)


def _is_threshold(rank, g):
    _is(rank, g, threshold=_pick(rank, 2.0, 3.0))


def _is_low(rank, g):
    _is(rank, g, low=_pick(rank, None, 0.5))


def _rs_criteria(rank, g):
    _, old, rollout, _, mask = _batch(rank)
    criteria = _pick(rank, {"token_k1": 2.0}, {"token_k1": 2.0, "seq_max_k2": 0.5})
    rlops.rollout_rejection_mask(old, rollout, mask, criteria, group=g)


def _rs_threshold(rank, g):
    _, old, rollout, _, mask = _batch(rank)
    criteria = {"token_k1": (0.5, 2.0), "seq_mean_k3": _pick(rank, 0.01, 0.02)}
    rlops.rollout_rejection_mask(old, rollout, mask, criteria, group=g)


def _one_function_each(rank, g):
    _, old, rollout, _, mask = _batch(rank)
    if rank == 0:
        rlops.rollout_mismatch_metrics(old, rollout, mask, group=g)
    else:
        rlops.rollout_importance_weights(old, rollout, mask, group=g)


def _cp_group_on_one_rank(rank, g):
    _, old, rollout, _, mask = _batch(0)  # the same rows on both ranks, as CP ranks hold
    cp = g if rank == 0 else None
    rlops.rollout_mismatch_metrics(old, rollout, mask, group=g, cp_group=cp)


def _cp_level(rank, g):
    _, old, rollout, _, mask = _batch(0)
    rlops.rollout_importance_weights(
        old, rollout, mask, level=_pick(rank, "sequence", "token"), group=g, cp_group=g
    )


def _cp_rows(rank, g):  # a [B, k] payload that fits the first exchange on one rank only
    _, old, rollout, _, mask = _batch(0, b=_pick(rank, 2, 40))
    rlops.rollout_mismatch_metrics(old, rollout, mask, group=g, cp_group=g)


def _stats_unbiased(rank, g):
    logp, _, _, _, mask = _batch(rank)
    rlops.masked_var(logp, mask, unbiased=rank == 0, group=g)


def _stats_function(rank, g):
    logp, _, _, _, mask = _batch(rank)
    if rank == 0:
        rlops.masked_mean(logp, mask, group=g)
    else:
        rlops.masked_whiten(logp, mask, group=g)


def _device_checksum(rank, g):  # a value of the description that lives on the device
    checksum = torch.tensor(1000 + _pick(rank, 0, 1), dtype=torch.int64)
    collectives.gather(torch.ones(3), g, Call("probe", checksum=checksum))


# name -> (case, what the message must contain)
MISMATCHES = {
    "aggregate_loss mode": (_agg_mode, ["`agg`: ['token-mean', 'seq-mean-token-mean']"]),
    "policy_loss agg": (_policy_agg, ["`agg`: ['token-mean', 'seq-mean-token-sum']"]),
    "policy_loss kind ppo vs cispo": (_policy_kind("cispo"), ["`kind`: ['ppo', 'cispo']"]),
    "policy_loss kind ppo vs gspo": (_policy_kind("gspo"), ["`kind`: ['ppo', 'gspo']"]),
    "policy_loss clip_low": (_policy_clip, ["`options`", "clip_low: 0.2", "clip_low: 0.25"]),
    "policy_loss seq-mean-token-sum-norm T": (
        _norm_length,
        ["`loss_scale_factor (or T)`", "[5.0, 6.0]"],
    ),
    "value_loss clip": (_value_clip, ["`clip`: [None, 0.5]"]),
    "entropy_loss vs aggregate_loss": (
        _entropy_vs_aggregate,
        ["`function`: ['entropy_loss', 'aggregate_loss']"],
    ),
    "rollout_importance_weights level": (_is_level, ["`level`: ['token', 'sequence']"]),
    "rollout_importance_weights batch_normalize": (
        _is_batch_normalize,
        ["`batch_normalize`: [True, False]"],
    ),
    "rollout_importance_weights threshold": (_is_threshold, ["`threshold`: [2.0, 3.0]"]),
    "rollout_importance_weights low": (_is_low, ["`low`: [None, 0.5]"]),
    "rollout_rejection_mask criteria (1 vs 2 options)": (
        _rs_criteria,
        ["`criteria`: [{token_k1: 2.0}, {token_k1: 2.0, seq_max_k2: 0.5}]"],
    ),
    "rollout_rejection_mask threshold": (_rs_threshold, ["seq_mean_k3: 0.01", "seq_mean_k3: 0.02"]),
    "rollout_mismatch_metrics vs rollout_importance_weights": (
        _one_function_each,
        ["`function`: ['rollout_mismatch_metrics', 'rollout_importance_weights']"],
    ),
    "rollout_mismatch_metrics cp_group on one rank": (
        _cp_group_on_one_rank,
        ["`cp_group size`: [2, 1]", "`collective over`: ['cp_group', 'group']"],
    ),
    "rollout_importance_weights(cp_group=) level": (_cp_level, ["`level`: ['sequence', 'token']"]),
    "rollout_mismatch_metrics(cp_group=) rows": (_cp_rows, ["`payload shape`: [(2, 2), (40, 2)]"]),
    "masked_var unbiased": (_stats_unbiased, ["`unbiased`: [True, False]"]),
    "masked_mean vs masked_whiten": (
        _stats_function,
        ["`function`: ['masked_mean', 'masked_whiten']"],
    ),
    "a checksum computed on the device": (_device_checksum, ["`checksum`: [1000, 1001]"]),
}


def _mismatch_work(rank, world):
    g = dist.group.WORLD
    out = {}
    for name, (case, _) in MISMATCHES.items():
        try:
            case(rank, g)
        except ValueError as e:
            out[name] = str(e)
        else:
            out[name] = None
    # equal device values pass (bit for bit), with the payload in the same exchange
    with count_collectives() as calls:
        checksum = torch.tensor(-(2**62) - 7, dtype=torch.int64)  # not exact in float64
        out["probe"] = collectives.gather(
            torch.arange(3.0) + rank, g, Call("probe", checksum=checksum, x=-0.0)
        )
    out["probe calls"] = dict(calls)
    # the group is still in step: a matching call afterwards gives the full batch's metrics
    _, old, rollout, _, mask = _batch(rank)
    out["after"] = rlops.rollout_mismatch_metrics(old, rollout, mask, group=g)
    return out


@pytest.mark.distributed
def test_every_mismatch_raises_the_same_error_on_every_rank():
    ranks = run_distributed(_mismatch_work, 2, timeout=120)
    for name, (_, expected) in MISMATCHES.items():
        msgs = [r[name] for r in ranks]
        assert msgs[0] is not None, f"{name}: no error"
        assert msgs[0] == msgs[1], f"{name}: the ranks raised different errors: {msgs}"
        assert msgs[0].startswith("the ranks of a process group disagree on "), msgs[0]
        for part in expected:
            assert part in msgs[0], f"{name}: {part!r} not in {msgs[0]!r}"
    # the kind names the difference; the options and payload size it implies are not repeated
    assert "options" not in ranks[0]["policy_loss kind ppo vs gspo"]
    assert "payload" not in ranks[0]["policy_loss kind ppo vs gspo"]
    for r in ranks:
        assert r["probe calls"] == {"all_gather": 1}
        assert torch.equal(r["probe"], torch.tensor([[0.0, 1, 2], [1, 2, 3]], dtype=F64))
    batches = [_batch(r) for r in (0, 1)]
    old, rollout, mask = (torch.cat([b[i] for b in batches]) for i in (1, 2, 4))
    want = rlops.rollout_mismatch_metrics(old, rollout, mask)
    for r in ranks:
        for k, v in want.items():
            torch.testing.assert_close(r["after"][k], v, rtol=1e-14, atol=1e-16)


# --------------------------------------------------------------------------- collectives
def _calls(rank, g):
    """Every function with a group path, on inputs that agree: name -> thunk."""
    logp, old, rollout, adv, mask = _batch(rank)
    _, cp_old, cp_rollout, _, cp_mask = _batch(0, b=2)  # CP ranks hold the same rows
    _, big_old, big_rollout, _, big_mask = _batch(0, b=40)
    criteria = {"token_k1": 2.0, "seq_max_k2": 0.5}
    return {
        "aggregate_loss token-mean": lambda: rlops.aggregate_loss(logp, mask, group=g),
        "aggregate_loss token-sum": lambda: rlops.aggregate_loss(logp, mask, "token-sum", group=g),
        "entropy_loss": lambda: rlops.entropy_loss(-logp, mask, group=g),
        "policy_loss ppo": lambda: rlops.policy_loss(logp, old, adv, mask, group=g),
        "policy_loss kl_cov": lambda: rlops.policy_loss(
            logp, old, adv, mask, kind="kl_cov", group=g
        ),
        "value_loss": lambda: rlops.value_loss(logp, old, adv, mask, clip=0.2, group=g),
        "masked_mean": lambda: rlops.masked_mean(logp, mask, group=g),
        "masked_var": lambda: rlops.masked_var(logp, mask, group=g),
        "masked_whiten": lambda: rlops.masked_whiten(logp, mask, group=g),
        "rollout_importance_weights": lambda: rlops.rollout_importance_weights(
            old, rollout, mask, level="sequence", batch_normalize=True, group=g
        ),
        "rollout_rejection_mask": lambda: rlops.rollout_rejection_mask(
            old, rollout, mask, criteria, group=g
        ),
        "rollout_rejection_mask, all 11 options": lambda: rlops.rollout_rejection_mask(
            old, rollout, mask, dict.fromkeys(rlops.rollout_correction.RS_OPTIONS, 5.0), group=g
        ),
        "rollout_mismatch_metrics": lambda: rlops.rollout_mismatch_metrics(
            old, rollout, mask, group=g
        ),
        "rollout_mismatch_metrics cp_group, [2, 2] rows": lambda: rlops.rollout_mismatch_metrics(
            cp_old, cp_rollout, cp_mask, group=g, cp_group=g
        ),
        "rollout_rejection_mask cp_group, [2, 5] rows": lambda: rlops.rollout_rejection_mask(
            cp_old, cp_rollout, cp_mask, criteria, group=g, cp_group=g
        ),
        "rollout_importance_weights cp_group, [40, 2] rows": lambda: (
            rlops.rollout_importance_weights(
                big_old, big_rollout, big_mask, level="geometric", group=g, cp_group=g
            )
        ),
    }


def _count_work(rank, world, check):
    import os

    os.environ[collectives.ENV] = check
    out = {}
    for name, thunk in _calls(rank, dist.group.WORLD).items():
        with count_collectives() as calls:
            result = thunk()
        out[name] = (dict(calls), result)
    return out


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [v for k in sorted(x) for v in _flat(x[k])]
    return [v for item in x for v in _flat(item)]


@pytest.mark.distributed
def test_the_check_rides_on_the_data_collective_and_changes_no_bit():
    on, off = (run_distributed(_count_work, 2, c, timeout=120) for c in ("1", "0"))
    for name in on[0]:
        calls_on, calls_off = on[0][name][0], off[0][name][0]
        # off: exactly the data collectives (none for token-sum, which needs no count); on:
        # the same, the check in the first of them, plus one exchange for a call that makes
        # none (token-sum) or whose payload exceeds the first exchange ([40, 2] row sums)
        data = 0 if "token-sum" in name else 2 if "cp_group" in name else 1
        extra = 1 if "token-sum" in name or "[40, 2]" in name else 0
        assert calls_off == ({"all_gather": data} if data else {}), (name, calls_off)
        assert calls_on == {"all_gather": data + extra}, (name, calls_on)
        for rank in (0, 1):
            a, b = _flat(on[rank][name][1]), _flat(off[rank][name][1])
            assert len(a) == len(b) and all(
                x.dtype == y.dtype
                and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
                for x, y in zip(a, b, strict=True)
            ), name


# --------------------------------------------------------------------------- one process
def test_digest_is_exact_in_float64_and_sees_every_bit():
    a = Call("f", x=0.1, mode="token-mean", flags=(True, None), n=3)
    assert a.digest() == Call("f", x=0.1, mode="token-mean", flags=(True, None), n=3).digest()
    for d in a.digest():
        assert 0 <= d < 2**52 and float(d) == d
    nudged = math.nextafter(0.1, 1.0)
    for other in (
        Call("g", x=0.1, mode="token-mean", flags=(True, None), n=3),
        Call("f", x=nudged, mode="token-mean", flags=(True, None), n=3),
        Call("f", x=0.1, mode="token-sum", flags=(True, None), n=3),
        Call("f", x=0.1, mode="token-mean", flags=(False, None), n=3),
        Call("f", x=0.1, mode="token-mean", flags=(True, None), n=3.0),
        Call("f", x=0.1, mode="token-mean", flags=(True, None)),
    ):
        assert other.digest() != a.digest()
    with pytest.raises(TypeError, match="described by"):
        Call("f", x=object())
    with pytest.raises(TypeError, match="0-dim real number"):
        Call("f", x=torch.ones(2))


def test_one_process_makes_no_collective():
    logp, old, rollout, adv, mask = _batch(0)
    with count_collectives() as calls:
        rlops.policy_loss(logp, old, adv, mask)
        rlops.masked_whiten(logp, mask)
        rlops.rollout_importance_weights(old, rollout, mask, batch_normalize=True)
    assert not calls
    assert SLOTS - 2 >= 59  # the largest fixed payload: rejection with all 11 options
