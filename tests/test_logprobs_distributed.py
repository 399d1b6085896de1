"""Vocabulary-parallel log-probs and entropy on real Gloo groups of 4 and of 2 processes.

Each rank holds ``V / tp`` columns of the same logits (or rows of the same output weight); its
outputs and gradient shard must equal the single-process result on the full vocabulary, with
exactly one collective in the forward and none in the backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed

from rlops.logprobs import (
    copy_to_tensor_parallel_region,
    linear_logprobs_and_entropy,
    logprobs_and_entropy,
)

pytestmark = pytest.mark.distributed

N, V, H = 23, 52, 6  # V divisible by 2 and 4; N not a multiple of any chunk size used

# name -> (dtype, keyword arguments of logprobs_and_entropy; "mask" adds a keep mask)
CASES = {
    "plain": (torch.float64, {}),
    "masked": (torch.float64, {"mask": True, "temperature": 1.7, "chunk_size": 7}),
    "no entropy": (torch.float64, {"with_entropy": False, "chunk_size": 4}),
    "entropy detached": (torch.float64, {"entropy_grad": False, "mask": True}),
    "float32": (torch.float32, {"temperature": 0.5, "chunk_size": 5}),
    "empty": (torch.float64, {"n": 0}),
}
LINEAR_CASES = {
    "linear": (torch.float64, {"temperature": 1.7, "chunk_size": 5}),
    "linear float32": (torch.float32, {"with_entropy": False}),
}


def _case(name: str, dtype: torch.dtype, kw: dict):
    kw = dict(kw)
    n = kw.pop("n", N)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    logits = (torch.randn(n, V, generator=gen) * 4).to(dtype)
    target = torch.randint(0, V, (n,), generator=gen)
    if kw.pop("mask", False):
        keep = torch.rand(n, V, generator=gen) < 0.3
        keep.scatter_(1, target[:, None], False)  # the op must keep the target itself
        keep[: n // 3, V // 4 :] = False  # rows whose other shards hold nothing kept
        keep[n // 3 : n // 2] = False  # rows that keep only the target
        kw["keep_mask"] = keep
    grads = [torch.randn(n, generator=gen).to(dtype) for _ in range(2)]
    return logits, target, grads, kw


def _linear_case(name: str, dtype: torch.dtype, kw: dict):
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    hidden = torch.randn(N, H, generator=gen).to(dtype)
    weight = torch.randn(V, H, generator=gen).to(dtype)
    target = torch.randint(0, V, (N,), generator=gen)
    grads = [torch.randn(N, generator=gen).to(dtype) for _ in range(2)]
    return hidden, weight, target, grads, dict(kw)


def _backward(outs, grads):
    pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o is not None and o.requires_grad]
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _run_cases(group, r: int, tp: int) -> dict:
    cols = slice(r * V // tp, (r + 1) * V // tp)
    res = {}
    for name, (dtype, kw) in CASES.items():
        logits, target, grads, kw = _case(name, dtype, kw)
        if "keep_mask" in kw:
            kw["keep_mask"] = kw["keep_mask"][:, cols]
        x = logits[:, cols].clone().requires_grad_()
        with count_collectives() as fwd:
            outs = logprobs_and_entropy(x, target, group=group, **kw)
        with count_collectives() as bwd:
            _backward(outs, grads)
        res[name] = {"outs": outs, "grads": [x.grad], "fwd": dict(fwd), "bwd": dict(bwd)}
    for name, (dtype, kw) in LINEAR_CASES.items():
        hidden, weight, target, grads, kw = _linear_case(name, dtype, kw)
        h = hidden.clone().requires_grad_()
        w = weight[cols].clone().requires_grad_()
        with count_collectives() as fwd:
            outs = linear_logprobs_and_entropy(h, w, target, group=group, **kw)
        with count_collectives() as bwd:
            _backward(outs, grads)
        # Through the column-parallel input op, every rank gets the full hidden gradient.
        h_full = hidden.clone().requires_grad_()
        outs_full = linear_logprobs_and_entropy(
            copy_to_tensor_parallel_region(h_full, group), weight[cols], target, group=group, **kw
        )
        with count_collectives() as bwd_layer:
            _backward(outs_full, grads)
        res[name] = {"outs": outs, "grads": [h.grad, w.grad], "fwd": dict(fwd), "bwd": dict(bwd),
                     "bwd_layer": dict(bwd_layer), "h_full": h_full.grad}
    return res


def _worker(rank: int, world_size: int, tps: tuple[int, ...]) -> dict:
    out = {}
    for tp in tps:
        if tp == world_size:
            group = dist.group.WORLD
        else:  # several tensor-parallel groups side by side: every rank creates every group
            groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world_size, tp)]
            group = groups[rank // tp]
        out[tp] = _run_cases(group, dist.get_rank(group), tp)
    return out


def _expected() -> dict:
    """Single-process results on the full vocabulary."""
    exp = {}
    for name, (dtype, kw) in CASES.items():
        logits, target, grads, kw = _case(name, dtype, kw)
        x = logits.clone().requires_grad_()
        outs = logprobs_and_entropy(x, target, **kw)
        _backward(outs, grads)
        exp[name] = {"outs": outs, "grads": [x.grad]}
    for name, (dtype, kw) in LINEAR_CASES.items():
        hidden, weight, target, grads, kw = _linear_case(name, dtype, kw)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        outs = linear_logprobs_and_entropy(h, w, target, **kw)
        _backward(outs, grads)
        exp[name] = {"outs": outs, "grads": [h.grad, w.grad]}
    return exp


def _close(a, b, msg):
    if a is None or b is None:
        assert a is None and b is None, msg
        return
    torch.testing.assert_close(a.detach(), b.detach(), msg=msg,
                               **({"rtol": 1e-12, "atol": 1e-12} if a.dtype == torch.float64
                                  else {}))


def _check(results: list[dict], tp: int) -> None:
    exp = _expected()
    for rank, per_tp in enumerate(results):
        res, r = per_tp[tp], rank % tp
        cols = slice(r * V // tp, (r + 1) * V // tp)
        for name, got in res.items():
            where = f"tp={tp} rank={rank} {name}"
            fwd_calls, bwd_calls = sum(got["fwd"].values()), sum(got["bwd"].values())
            assert fwd_calls == 1 and "gather" in next(iter(got["fwd"])), (where, got["fwd"])
            assert bwd_calls == 0, (where, got["bwd"])
            for k, (a, b) in enumerate(zip(got["outs"], exp[name]["outs"], strict=True)):
                _close(a, b, f"{where} output {k}")
            if name in LINEAR_CASES:
                _close(got["grads"][1], exp[name]["grads"][1][cols], f"{where} grad weight")
                group_ranks = range(rank - r, rank - r + tp)
                summed = sum(results[q][tp][name]["grads"][0] for q in group_ranks)
                _close(summed, exp[name]["grads"][0], f"{where} sum of partial grad hidden")
                _close(got["h_full"], exp[name]["grads"][0], f"{where} reduced grad hidden")
                assert got["bwd_layer"] == {"all_reduce": 1}, (where, got["bwd_layer"])
            else:
                _close(got["grads"][0], exp[name]["grads"][0][:, cols], f"{where} grad")


def test_groups_of_four_and_of_two():
    """One spawn of 4 processes (spawning is the slow part): the vocabulary sharded over all 4,
    then over two groups of 2 side by side (ranks {0, 1} and {2, 3}, group ranks 0 and 1)."""
    results = run_distributed(_worker, 4, (4, 2), timeout=180)
    _check(results, 4)
    _check(results, 2)


def _check_calls_single(group):
    x = torch.randn(5, 8, requires_grad=True)
    with count_collectives() as calls:
        lp, ent = logprobs_and_entropy(x, torch.arange(5), group=group)
        (lp.sum() + ent.sum()).backward()
    return dict(calls)


def test_no_collective_without_group():
    assert _check_calls_single(None) == {}
