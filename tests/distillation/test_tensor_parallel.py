"""Vocabulary-parallel distillation on real Gloo groups of 4 and 2 processes: each rank holds a
contiguous slice of the logits' columns (or of the output layer's rows); its loss and metrics
must equal the single-process result, its gradient shard the slice of the full gradient, and
(for the fused output layer) the ranks' partial hidden gradients must sum to the full one.
A top-k teacher, or a full one with forward or reverse KL without the clamp, costs the forward
one checked exchange (the shard sizes) and one gather of the statistics; a full teacher with the
JSD or the clamp one more (the rows' sums); the backward none."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed
from tests.distillation._util import teacher

from rlops import distillation_loss, linear_distillation_loss

pytestmark = pytest.mark.distributed

N, V, H = 23, 52, 6
UNEQUAL = {4: (10, 17, 12, 13), 2: (20, 32)}

# name -> (dtype, top-k (None: full teacher), keywords, unequal shards, linear op)
CASES = {
    "forward tail clamp": (
        torch.float64,
        6,
        dict(tail=True, log_prob_min_clamp=-4.0, temperature=0.8),
        False,
        False,
    ),
    "reverse tail unequal": (torch.float64, 6, dict(kind="reverse_kl", tail=True), True, False),
    "jsd unequal": (torch.float64, 5, dict(kind="jsd", beta=0.3), True, False),
    "full forward": (torch.float64, None, dict(temperature=1.3), False, False),
    "full jsd unequal clamp": (
        torch.float64,
        None,
        dict(kind="jsd", log_prob_min_clamp=-6.0),
        True,
        False,
    ),
    "float32 reverse tail": (torch.float32, 7, dict(kind="reverse_kl", tail=True), False, False),
    "linear tail unequal": (torch.float64, 6, dict(tail=True, kind="jsd"), True, True),
    "full forward clamp unequal": (
        torch.float64,
        None,
        dict(log_prob_min_clamp=-5.0),
        True,
        False,
    ),
    "float32 full reverse unequal": (
        torch.float32,
        None,
        dict(kind="reverse_kl", temperature=0.7),
        True,
        False,
    ),
    "linear full": (torch.float64, None, dict(kind="reverse_kl"), False, True),
}


def _gathers(name):
    """The forward's gathers: two for a full teacher whose divergence needs the whole
    log-normaliser first (the JSD, the clamp), one otherwise."""
    _, k, kw, _, _ = CASES[name]
    two = k is None and (kw.get("kind") == "jsd" or kw.get("log_prob_min_clamp") is not None)
    return 2 if two else 1


def _sizes(world, unequal):
    return UNEQUAL[world] if unequal else (V // world,) * world


def _inputs(name):
    dtype, k, kw, _, _ = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    a, ids = teacher((N, V), k, seed=len(name))
    w_out = torch.randn(N, generator=g, dtype=torch.float64)
    return [x.to(dtype) for x in (hidden, weight, bias, a, w_out)] + [ids], kw


def _run(name, cols=None, group=None):
    """``(loss, metrics, grads)`` on the columns ``cols`` (None: all), and the collectives of
    the forward and the backward."""
    (hidden, weight, bias, a, w_out, ids), kw = _inputs(name)
    linear = CASES[name][4]
    cols = slice(None) if cols is None else cols
    if ids is None:
        a = a[:, cols]
    with count_collectives() as fwd:
        if linear:
            leaves = [
                hidden.clone().requires_grad_(),
                weight[cols].clone().requires_grad_(),
                bias[cols].clone().requires_grad_(),
            ]
            loss, metrics = linear_distillation_loss(
                *leaves[:2], a, ids, bias=leaves[2], group=group, **kw
            )
        else:
            leaves = [(hidden @ weight.T + bias)[:, cols].clone().requires_grad_()]
            loss, metrics = distillation_loss(leaves[0], a, ids, group=group, **kw)
    with count_collectives() as bwd:
        (loss * w_out).sum().backward()
    return loss.detach(), metrics, [x.grad for x in leaves], sum(fwd.values()), sum(bwd.values())


def _work(rank, world):
    out = {}
    for name, (_, _k, _, unequal, _) in CASES.items():
        sizes = _sizes(world, unequal)
        start = sum(sizes[:rank])
        out[name] = _run(name, slice(start, start + sizes[rank]), dist.group.WORLD)
    os.environ["RLOPS_TP_CHECK"] = "0"  # equal shards, no exchange: one gather
    equal = slice(rank * V // world, (rank + 1) * V // world)
    out["unchecked"] = _run("forward tail clamp", equal, dist.group.WORLD)
    out["unchecked full"] = _run("full forward", equal, dist.group.WORLD)
    del os.environ["RLOPS_TP_CHECK"]
    try:  # rank 0 asks for another kind: every rank raises the same ValueError
        _run(
            "jsd unequal" if rank else "reverse tail unequal",
            slice(*[sum(_sizes(world, True)[:r]) for r in (rank, rank + 1)]),
            dist.group.WORLD,
        )
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    z = torch.zeros(3, V // world)
    ids = torch.tensor([[0, 1]] * 3)
    try:  # rank 1's own check fails (beta): it joins the exchange, every rank raises
        distillation_loss(z, torch.full((3, 2), -1.0), ids, beta=2.0 if rank == 1 else 0.5,
                          group=dist.group.WORLD)  # fmt: skip
        out["rejected"] = None
    except ValueError as e:
        out["rejected"] = str(e)
    return out


@pytest.fixture(scope="module", params=[4, 2])
def results(request):
    return request.param, run_distributed(_work, request.param)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_single_process(results, name):
    world, ranks = results
    loss, metrics, grads, _, _ = _run(name)
    unequal, linear = CASES[name][3], CASES[name][4]
    sizes = _sizes(world, unequal)
    hidden_sum = 0
    for r, res in enumerate(ranks):
        l_r, m_r, g_r, fwd, bwd = res[name]
        torch.testing.assert_close(l_r, loss, rtol=1e-5, atol=1e-6)
        assert m_r.keys() == metrics.keys()
        for key in metrics:
            torch.testing.assert_close(m_r[key], metrics[key], rtol=1e-5, atol=1e-6)
        cols = slice(sum(sizes[:r]), sum(sizes[: r + 1]))
        if linear:
            hidden_sum = hidden_sum + g_r[0]
            torch.testing.assert_close(g_r[1], grads[1][cols], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(g_r[2], grads[2][cols], rtol=1e-5, atol=1e-6)
        else:
            torch.testing.assert_close(g_r[0], grads[0][:, cols], rtol=1e-5, atol=1e-6)
        assert fwd == 1 + _gathers(name), fwd  # the checked exchange and the gathers
        assert bwd == 0
    if linear:  # partial hidden gradients: their sum is the whole one
        torch.testing.assert_close(hidden_sum, grads[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("key", "name"), [("unchecked", "forward tail clamp"),
                                         ("unchecked full", "full forward")])  # fmt: skip
def test_unchecked_is_one_gather(results, key, name):
    _world, ranks = results
    loss, metrics = _run(name)[:2]
    for res in ranks:
        torch.testing.assert_close(res[key][0], loss)
        torch.testing.assert_close(res[key][1]["teacher_mass"], metrics["teacher_mass"])
        assert res[key][3] == 1 and res[key][4] == 0


def test_mismatched_calls_raise_on_every_rank(results):
    _, ranks = results
    msgs = [res["mismatch"] for res in ranks]
    assert all(m is not None and "disagree" in m and "kind" in m for m in msgs), msgs


def test_a_rank_rejecting_its_arguments_fails_every_rank(results):
    _, ranks = results
    msgs = [res["rejected"] for res in ranks]
    assert all(m is not None and "beta" in m for m in msgs), msgs
