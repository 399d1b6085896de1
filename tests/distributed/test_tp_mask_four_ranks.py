"""Four vocabulary shards (Gloo ranks) with a row ``mask`` and CSR support sets: the values and
gradients of the unsharded call, exact zeros on the masked rows, and the forward's documented
collectives: 2 (the consistency check and the statistics), none in the backward.

The vocabulary of 41 ids splits into shards of 10, 10, 10 and 11 (``rank * V // 4``), so the
shards differ in size; the sets hold ids on both sides of every shard boundary (9 | 10,
19 | 20, 29 | 30), targets on either side of them, an empty set (only the target kept) and a
set that spans every shard. The expected values are the same op in one process on the whole
vocabulary, with the sets as CSR and as the dense ``keep_mask`` (their documented meaning).
The two-rank cases of the same ops stay in the fast tier (``tests/logprobs/test_mask.py``,
``tests/logprobs/test_csr_support.py``); this one is slow.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed

from rlops.logprobs import linear_logprobs_and_entropy, logprobs_and_entropy

WORLD, N, V, H = 4, 10, 41, 5


def _cols(rank: int) -> slice:
    return slice(rank * V // WORLD, (rank + 1) * V // WORLD)


def _inputs():
    g = torch.Generator().manual_seed(41)
    sets = [
        torch.tensor([9, 10]),
        torch.tensor([19, 20, 21]),
        torch.tensor([], dtype=torch.int64),
        torch.tensor([29, 30, 0, 40]),
        torch.arange(0, V, 4),
        torch.tensor([10, 9, 9]),  # a duplicate: a set
        torch.tensor([5]),
        torch.tensor([39, 40, 30, 29, 20, 19, 10, 9]),
        torch.tensor([1, 2]),
        torch.tensor([35]),
    ]
    lengths = torch.tensor([len(s) for s in sets])
    ids = torch.cat(sets)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    keep = torch.zeros(N, V, dtype=torch.bool)
    for row, s in enumerate(sets):
        keep[row, s] = True
    target = torch.tensor([10, 19, 7, 30, 12, 9, 29, 40, 20, 0])
    mask = torch.tensor([1, 1, 0, 1, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    grads = [torch.randn(N, generator=g, dtype=torch.float64) for _ in range(2)]
    return logits, hidden, weight, target, mask, ids, offsets, keep, grads


CASES = ("logits mask", "logits mask csr", "linear mask csr")


def _call(case: str, rank: int | None, group=None):
    """One case on shard ``rank`` (None: the whole vocabulary, one process): ``(outputs,
    gradients, forward collectives, backward collectives)``."""
    logits, hidden, weight, target, mask, ids, offsets, _, grads = _inputs()
    cols = slice(None) if rank is None else _cols(rank)
    kw = {"mask": mask, "group": group, "with_sum_pi_squared": True}
    if "csr" in case:
        kw.update(support_ids=ids, support_offsets=offsets)
    if case.startswith("logits"):
        leaves = [logits[:, cols].clone().requires_grad_()]
        with count_collectives() as fwd:
            res = logprobs_and_entropy(leaves[0], target, **kw)
    else:
        leaves = [hidden.clone().requires_grad_(), weight[cols].clone().requires_grad_()]
        with count_collectives() as fwd:
            res = linear_logprobs_and_entropy(*leaves, target, **kw)
    with count_collectives() as bwd:
        torch.autograd.backward(list(res[:2]), grads)
    return [r.detach() for r in res], [x.grad for x in leaves], sum(fwd.values()), sum(bwd.values())


def _dense_reference(case: str):
    """The case in one process with the sets as the dense ``keep_mask``."""
    logits, hidden, weight, target, mask, _, _, keep, grads = _inputs()
    kw = {"mask": mask, "keep_mask": keep, "with_sum_pi_squared": True}
    if case.startswith("logits"):
        leaves = [logits.clone().requires_grad_()]
        res = logprobs_and_entropy(leaves[0], target, **kw)
    else:
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        res = linear_logprobs_and_entropy(*leaves, target, **kw)
    torch.autograd.backward(list(res[:2]), grads)
    return [r.detach() for r in res], [x.grad for x in leaves]


def _worker(rank: int, world: int) -> dict:
    assert world == WORLD
    return {case: _call(case, rank, dist.group.WORLD) for case in CASES}


@pytest.mark.slow
@pytest.mark.distributed
def test_four_shards_with_a_row_mask_and_csr_sets_equal_the_unsharded_call():
    results = run_distributed(_worker, WORLD, timeout=240)
    mask = _inputs()[4]
    for case in CASES:
        ref, ref_grads, _, _ = _call(case, None)
        if "csr" in case:
            dense, dense_grads = _dense_reference(case)
            for a, b in zip(ref + ref_grads, dense + dense_grads, strict=True):
                assert torch.equal(a, b), case  # the CSR sets are the dense mask
        for rank, res in enumerate(results):
            outs, grads, n_fwd, n_bwd = res[case]
            where = f"{case}, rank {rank}"
            for o, r in zip(outs, ref, strict=True):
                torch.testing.assert_close(o, r, msg=lambda m, w=where: f"{w}: {m}")
                assert torch.equal(o[~mask], torch.zeros_like(o[~mask])), (case, rank)
            if case.startswith("logits"):
                want = [ref_grads[0][:, _cols(rank)]]
            else:  # the hidden gradient is this shard's part (summed by the layer's input)
                want = [None, ref_grads[1][_cols(rank)]]
            for gx, gw in zip(grads, want, strict=True):
                if gw is not None:
                    torch.testing.assert_close(gx, gw, msg=lambda m, w=where: f"{w}: {m}")
            assert torch.equal(grads[0][~mask], torch.zeros_like(grads[0][~mask])), (case, rank)
            # the consistency check and the statistics; the backward is local
            assert (n_fwd, n_bwd) == (2, 0), (case, rank, n_fwd, n_bwd)
    # the shards' hidden gradients sum to the unsharded one
    ref_h = _call("linear mask csr", None)[1][0]
    total = sum(res["linear mask csr"][1][0] for res in results)
    torch.testing.assert_close(total, ref_h)
