"""rlops.compat.trl.grpo_loss on 2 Gloo processes: the top-entropy quantile is over every
process's completion tokens, as TRL's ``get_high_entropy_mask`` gathers them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tests._distributed import run_distributed

from rlops.compat.trl import grpo_loss


def _batch():
    g = torch.Generator().manual_seed(0)
    b, t = 4, 5
    mask = (torch.arange(t) < torch.tensor([5, 2, 4, 3])[:, None]).long()
    return torch.zeros(b, t), torch.randn(b, generator=g), mask, torch.rand(b, t, generator=g)


def _work(rank, world_size, q):
    lp, adv, mask, ent = _batch()
    rows = slice(2 * rank, 2 * rank + 2)
    out = {}
    for name, group in (("group", dist.group.WORLD), ("alone", None)):
        loss, _ = grpo_loss(
            lp[rows].clone().requires_grad_(),
            None,
            adv[rows],
            mask[rows],
            loss_type="bnpo",
            entropies=ent[rows],
            top_entropy_quantile=q,
            group=group,
        )
        out[name] = loss.detach()
    return out


def test_entropy_quantile_over_the_group():
    q = 0.5
    results = run_distributed(_work, 2, q)
    _, adv, mask, ent = _batch()
    keep = mask.bool()
    # TRL: the threshold is torch.quantile of every process's entropies at 1 - q
    threshold = torch.quantile(ent[keep], 1 - q)
    kept = keep & (ent >= threshold)
    for rank, got in enumerate(results):
        rows = slice(2 * rank, 2 * rank + 2)
        # on-policy (ratio 1) the ppo loss of a token is -A; bnpo divides by the process's
        # completion tokens, kept or not
        expected = (-adv[rows, None] * kept[rows]).sum() / keep[rows].sum()
        torch.testing.assert_close(got["group"], expected)
    assert any(not torch.equal(r["group"], r["alone"]) for r in results)  # the group matters
