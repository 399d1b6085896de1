"""Context-parallel scans on real Gloo groups: each rank's shard of the result equals the
single-process computation on the whole batch, with one collective of a size independent of T."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from tests._distributed import RankError, count_collectives, run_distributed

import rlops
from rlops.distributed import (
    zigzag_shard,
    zigzag_shard_response,
    zigzag_unshard,
    zigzag_unshard_response,
)

pytestmark = pytest.mark.distributed

LENGTHS = (1, 2, 5, 8, 33, 130)


def _batch(t_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    b = 3
    r = torch.randn(b, t_len, generator=g, dtype=torch.float64)
    v = torch.randn(b, t_len, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t_len, generator=g) > 0.35
    mask[:, t_len // 3 : t_len // 2] = False  # an interior tool span
    mask[-1] = False  # a row with no action token
    dones = torch.rand(b, t_len, generator=g) > 0.9
    kl = torch.randn(b, t_len, generator=g, dtype=torch.float64)
    outcome = torch.randn(b, generator=g, dtype=torch.float64)
    decay = torch.rand(b, t_len, generator=g, dtype=torch.float64)
    gamma_rows = torch.rand(b, generator=g, dtype=torch.float64) * 0.5 + 0.5
    return r, v, mask, dones, kl, outcome, decay, gamma_rows


def _every_function(rank: int, world: int, methods: tuple[str, ...]) -> float:
    """Max abs error of every CP function vs single-process, over lengths and methods."""
    group = dist.group.WORLD
    worst = 0.0

    def shard(x):
        return zigzag_shard(x, cp_size=world, cp_rank=rank)

    for t_len in LENGTHS:
        r, v, m, d, kl, outcome, decay, g_rows = _batch(t_len, seed=t_len)
        for method in methods:
            pairs = []
            want = rlops.gae(r, v, gamma=0.99, lam=0.9, mask=m, dones=d, method="reference")
            got = rlops.gae(
                shard(r), shard(v), gamma=0.99, lam=0.9, mask=shard(m), dones=shard(d),
                method=method, cp_group=group,
            )
            pairs += list(zip(want, got, strict=True))
            want = rlops.gae(r, v, gamma=g_rows, lam=0.95, method="reference")
            got = rlops.gae(shard(r), shard(v), gamma=g_rows, lam=0.95, method=method,
                            cp_group=group)
            pairs += list(zip(want, got, strict=True))
            pairs.append((
                rlops.discounted_returns(r, gamma=0.9, mask=m, dones=d, method="reference"),
                rlops.discounted_returns(shard(r), gamma=0.9, mask=shard(m), dones=shard(d),
                                         method=method, cp_group=group),
            ))
            pairs.append((
                rlops.reinforce_plus_plus_returns(outcome, kl, m, kl_coef=0.1, gamma=0.95,
                                                  method="reference"),
                rlops.reinforce_plus_plus_returns(outcome, shard(kl), shard(m), kl_coef=0.1,
                                                  gamma=0.95, method=method, cp_group=group),
            ))
            for disc in (0.97, decay, g_rows[:, None], 0.0, 1.0):
                pairs.append((
                    rlops.discounted_cumsum(r, disc, method="reference"),
                    rlops.discounted_cumsum(
                        shard(r), shard(disc) if disc is decay else disc, method=method,
                        cp_group=group,
                    ),
                ))
            for want, got in pairs:
                full = zigzag_unshard(got, group=group, length=t_len)
                worst = max(worst, (full - want).abs().max().item())
    return worst


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_cp_function_equals_single_process(world):
    methods = ("reference", "chunked", "compiled") if world == 2 else ("auto",)
    errors = run_distributed(_every_function, world, methods, timeout=120)
    assert max(errors) < 1e-12, errors


def _response_form(rank: int, world: int) -> list[tuple[int, int, float]]:
    group = dist.group.WORLD
    bad = []
    for total in range(2, 302):
        for response in {1, 2, total // 2, total - 1}:
            if not 1 <= response <= total - 1:
                continue
            g = torch.Generator().manual_seed(total * 1000 + response)
            r = torch.randn(2, response, generator=g, dtype=torch.float64)
            v = torch.randn(2, response, generator=g, dtype=torch.float64)
            want_adv, _ = rlops.gae(r, v, gamma=1.0, lam=0.95)
            kw = dict(total_length=total, response_length=response, cp_size=world, cp_rank=rank)
            r_loc, mask = zigzag_shard_response(r, **kw)
            v_loc, _ = zigzag_shard_response(v, **kw)
            adv, _ = rlops.gae(r_loc, v_loc, gamma=1.0, lam=0.95,
                               mask=mask.expand_as(r_loc), cp_group=group)
            back = zigzag_unshard_response(adv, group=group, total_length=total,
                                           response_length=response)
            err = (back - want_adv).abs().max().item()
            if err > 1e-12:
                bad.append((total, response, err))
    return bad


def test_response_offset_form_every_length():
    """Prompt + response of every total length up to 301: ranks may hold none of it."""
    for bad in run_distributed(_response_form, 4, timeout=150):
        assert bad == []


def _count(rank: int, world: int, t_len: int):
    os.environ["RLOPS_CP_CHECK"] = "0"
    r, v, m, d, *_ = _batch(t_len, seed=0)
    shard = lambda x: zigzag_shard(x, cp_size=world, cp_rank=rank)  # noqa: E731
    sizes = []
    orig = dist.all_gather

    def spy(tensor_list, tensor, *a, **k):
        sizes.append(tensor.numel() * tensor.element_size())
        return orig(tensor_list, tensor, *a, **k)

    out = {}
    dist.all_gather = spy
    try:
        for name, call in {
            "gae": lambda: rlops.gae(shard(r), shard(v), gamma=1.0, lam=0.95, mask=shard(m),
                                     dones=shard(d), cp_group=dist.group.WORLD),
            "returns": lambda: rlops.discounted_returns(shard(r), gamma=0.9, mask=shard(m),
                                                       cp_group=dist.group.WORLD),
            "cumsum": lambda: rlops.discounted_cumsum(shard(r), 0.9, cp_group=dist.group.WORLD),
        }.items():
            sizes.clear()
            with count_collectives() as calls:
                call()
            out[name] = (dict(calls), list(sizes))
    finally:
        dist.all_gather = orig
    return out


def test_one_collective_whose_size_does_not_grow_with_t():
    short = run_distributed(_count, 4, 64)[0]
    long = run_distributed(_count, 4, 131072)[0]
    for name in short:
        calls, sizes = long[name]
        assert calls == {"all_gather": 1}, (name, calls)
        assert sizes == short[name][1], (name, sizes, short[name][1])
    # bytes per rank for B=3 rows: header + (2 chunks x 3 rows x 5 numbers) float64
    assert long["gae"][1] == [(4 + 2 * 3 * 5) * 8]


def _mismatch(rank: int, world: int):
    t_len = 16 if rank == 0 else 24  # rank 0 holds shards of another layout
    x = torch.randn(2, t_len)
    rlops.discounted_cumsum(x, 0.9, cp_group=dist.group.WORLD)


def test_mismatched_shards_raise_instead_of_hanging():
    with pytest.raises(RankError, match="disagree on the local length"):
        run_distributed(_mismatch, 2, timeout=60)


def test_odd_local_length_is_rejected_without_a_collective():
    with pytest.raises(ValueError, match="two zigzag chunks"):
        from rlops.advantages.context_parallel import cp_scan

        cp_scan(torch.zeros(1, 3), 0.5, None, "chunked")


def test_zigzag_round_trip_and_bad_arguments():
    x = torch.arange(2 * 13).reshape(2, 13)
    shards = [zigzag_shard(x, cp_size=3, cp_rank=r) for r in range(3)]
    assert all(s.shape == (2, 6) for s in shards)  # padded to 18, two chunks of 3 per rank
    assert torch.equal(zigzag_unshard(shards[0], group=None, length=6), shards[0])
    with pytest.raises(ValueError, match="cp_rank"):
        zigzag_shard(x, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="cp_size"):
        zigzag_shard(x, cp_size=0, cp_rank=0)
    with pytest.raises(TypeError, match="cp_size"):
        zigzag_shard(x, cp_size=2.0, cp_rank=0)
    with pytest.raises(ValueError, match="response_length"):
        zigzag_shard_response(x, total_length=13, response_length=14, cp_size=1, cp_rank=0)
    with pytest.raises(ValueError, match="response_length"):
        zigzag_shard_response(x, total_length=20, response_length=5, cp_size=1, cp_rank=0)


def test_cp_group_must_be_a_process_group():
    x = torch.zeros(1, 4)
    with pytest.raises(TypeError, match=r"cp_group must be a torch\.distributed\.ProcessGroup"):
        rlops.gae(x, x, gamma=1.0, lam=1.0, cp_group=object())
    with pytest.raises(TypeError, match="cp_group"):
        rlops.discounted_cumsum(x, 0.5, cp_group="world")
