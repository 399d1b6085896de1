"""A rank whose own argument checks fail does not leave the others waiting.

Every public function with ``group=`` / ``cp_group=`` is wrapped by
:func:`rlops.distributed.collectives.fails_together`: the failing rank joins the first exchange
of each group it has not reached, describing only the argument it rejected, and raises its own
error; every other rank of those groups raises a ``ValueError`` naming that argument. Run on 4
real Gloo ranks: ``cp_group`` = {0, 1} or {2, 3}, ``group`` = all four (DP × CP). A hang would
be a ``TimeoutError`` of the harness, not a pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tests._distributed import run_distributed

import rlops
from rlops.distributed.collectives import REJECTED

pytestmark = pytest.mark.distributed


def _outcome(call):
    try:
        call()
    except (ValueError, TypeError) as e:
        return ("ValueError" if isinstance(e, ValueError) else type(e).__name__), str(e)
    return "ok", ""


def _work(rank, world):
    cps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp, dp = cps[rank // 2], dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    b, t = 3, 8
    logp, old, adv = (-torch.rand(b, t, generator=g) for _ in range(3))
    mask = torch.ones(b, t, dtype=torch.bool)
    bad_mask = torch.ones(b, t + 1, dtype=torch.bool)
    out = {}
    # 1. DP only: rank 1's mask has the wrong shape
    out["policy_dp"] = _outcome(
        lambda: rlops.policy_loss(logp, old, adv, bad_mask if rank == 1 else mask, group=dp)
    )
    # 2. CP and DP: rank 0 rejects; its CP peer and the other CP group fail with it
    out["policy_cp_dp"] = _outcome(
        lambda: rlops.policy_loss(
            logp, old, adv, bad_mask if rank == 0 else mask, kind="gspo", cp_group=cp, group=dp
        )
    )
    # 3. statistics over DP: rank 2 gives an integer x
    x = torch.arange(b * t).reshape(b, t) if rank == 2 else logp
    out["whiten"] = _outcome(lambda: rlops.masked_whiten(x, mask, group=dp))
    # 4. a CP scan: rank 1's gamma is out of range; only its CP group is concerned
    out["gae"] = _outcome(
        lambda: rlops.gae(logp, old, gamma=1.5 if rank == 1 else 0.9, lam=0.95, cp_group=cp)
    )
    # 5. rollout correction over CP and DP: rank 3's threshold is negative
    out["rollout"] = _outcome(
        lambda: rlops.rollout_importance_weights(
            old,
            logp,
            mask,
            level="sequence",
            threshold=-1.0 if rank == 3 else 2.0,
            cp_group=cp,
            group=dp,
        )
    )
    # 6. a batch-wide selection: rank 0's threshold is negative
    out["m2po"] = _outcome(
        lambda: rlops.m2po_mask(old, logp, mask, threshold=-0.1 if rank == 0 else 0.04, group=dp)
    )
    # 7. the groups are still usable: a correct call after all that
    loss = rlops.aggregate_loss(logp, mask, "token-mean", group=dp)
    out["after"] = (float(loss), float(logp.sum()), int(mask.sum()))
    return out


def test_a_rank_that_rejects_its_arguments_fails_the_others_instead_of_hanging():
    res = run_distributed(_work, 4, timeout=240)

    def check(case, failing, concerned):
        for r in range(4):
            kind, msg = res[r][case]
            if r == failing:
                assert kind in ("ValueError", "TypeError") and REJECTED not in msg, (case, r, msg)
            elif r in concerned:
                assert kind == "ValueError" and REJECTED in msg, (case, r, msg)
            else:
                assert kind == "ok", (case, r, msg)

    check("policy_dp", 1, {0, 2, 3})
    check("policy_cp_dp", 0, {1, 2, 3})
    check("whiten", 2, {0, 1, 3})
    check("gae", 1, {0})
    check("rollout", 3, {0, 1, 2})
    check("m2po", 0, {1, 2, 3})
    assert "mask" in res[0]["policy_dp"][1] and "mask" in res[3]["policy_cp_dp"][1]
    # the ranks' token-mean shares sum to the mean over all four ranks' tokens
    total = sum(res[r]["after"][1] for r in range(4)) / sum(res[r]["after"][2] for r in range(4))
    assert sum(res[r]["after"][0] for r in range(4)) == pytest.approx(total, rel=1e-6)
