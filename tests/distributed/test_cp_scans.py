"""Context-parallel scans on real Gloo groups: each rank's shard of the result equals the
single-process computation on the whole batch, with one collective of a size independent of T."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed

import rlops
from rlops.compat.slime import zigzag_shard_response, zigzag_unshard_response
from rlops.distributed import zigzag_shard, zigzag_unshard
from rlops.distributed.collectives import SLOTS

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
                shard(r),
                shard(v),
                gamma=0.99,
                lam=0.9,
                mask=shard(m),
                dones=shard(d),
                method=method,
                cp_group=group,
            )
            pairs += list(zip(want, got, strict=True))
            want = rlops.gae(r, v, gamma=g_rows, lam=0.95, method="reference")
            got = rlops.gae(
                shard(r), shard(v), gamma=g_rows, lam=0.95, method=method, cp_group=group
            )
            pairs += list(zip(want, got, strict=True))
            pairs.append(
                (
                    rlops.discounted_returns(r, gamma=0.9, mask=m, dones=d, method="reference"),
                    rlops.discounted_returns(
                        shard(r),
                        gamma=0.9,
                        mask=shard(m),
                        dones=shard(d),
                        method=method,
                        cp_group=group,
                    ),
                )
            )
            pairs.append(
                (
                    rlops.reinforce_plus_plus_returns(
                        outcome, kl, m, kl_coef=0.1, gamma=0.95, method="reference"
                    ),
                    rlops.reinforce_plus_plus_returns(
                        outcome,
                        shard(kl),
                        shard(m),
                        kl_coef=0.1,
                        gamma=0.95,
                        method=method,
                        cp_group=group,
                    ),
                )
            )
            for disc in (0.97, decay, g_rows[:, None], 0.0, 1.0):
                pairs.append(
                    (
                        rlops.discounted_cumsum(r, disc, method="reference"),
                        rlops.discounted_cumsum(
                            shard(r),
                            shard(disc) if disc is decay else disc,
                            method=method,
                            cp_group=group,
                        ),
                    )
                )
            for want, got in pairs:
                full = zigzag_unshard(got, group=group, length=t_len)
                worst = max(worst, (full - want).abs().max().item())
    return worst


@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_cp_function_equals_single_process(world):
    methods = ("reference", "chunked", "compiled") if world == 2 else ("auto",)
    errors = run_distributed(_every_function, world, methods, timeout=120)
    assert max(errors) < 1e-12, errors


def _response_form(rank: int, world: int, last: int) -> list[tuple[int, int, float]]:
    group = dist.group.WORLD
    bad = []
    for total in range(2, last + 1):
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
            adv, _ = rlops.gae(
                r_loc, v_loc, gamma=1.0, lam=0.95, mask=mask.expand_as(r_loc), cp_group=group
            )
            back = zigzag_unshard_response(
                adv, group=group, total_length=total, response_length=response
            )
            err = (back - want_adv).abs().max().item()
            if err > 1e-12:
                bad.append((total, response, err))
    return bad


@pytest.mark.parametrize(("world", "last"), [(2, 40), pytest.param(4, 301, marks=pytest.mark.slow)])
def test_response_offset_form_every_length(world, last):
    """Prompt + response of every total length up to ``last``: ranks may hold none of it."""
    for bad in run_distributed(_response_form, world, last, timeout=150):
        assert bad == []


def _cp_calls(rank: int, world: int, t_len: int, b: int = 3):
    """Every CP function on matching zigzag shards: name -> thunk."""
    g = torch.Generator().manual_seed(t_len * 7 + b)
    r, v, kl = (torch.randn(b, t_len, generator=g, dtype=torch.float64) for _ in range(3))
    m, d = torch.rand(b, t_len, generator=g) > 0.3, torch.rand(b, t_len, generator=g) > 0.9
    outcome = torch.randn(b, generator=g, dtype=torch.float64)
    g_rows = torch.rand(b, generator=g, dtype=torch.float64)
    shard = lambda x: zigzag_shard(x, cp_size=world, cp_rank=rank)  # noqa: E731
    w = dist.group.WORLD
    return {
        "gae": lambda: rlops.gae(
            shard(r), shard(v), gamma=1.0, lam=0.95, mask=shard(m), dones=shard(d), cp_group=w
        ),
        "gae float32": lambda: rlops.gae(
            shard(r).float(), shard(v).float(), gamma=g_rows, lam=0.9, mask=shard(m), cp_group=w
        ),
        "returns": lambda: rlops.discounted_returns(shard(r), gamma=0.9, mask=shard(m), cp_group=w),
        "reinforce++": lambda: rlops.reinforce_plus_plus_returns(
            outcome, shard(kl), shard(m), kl_coef=0.1, gamma=0.95, cp_group=w
        ),
        "cumsum": lambda: rlops.discounted_cumsum(shard(r), 0.9, cp_group=w),
        "cumsum per-row": lambda: rlops.discounted_cumsum(shard(r), g_rows[:, None], cp_group=w),
    }


def _count(rank: int, world: int, t_len: int, env: dict, b: int = 3):
    os.environ.update(env)
    sizes = []
    orig = dist.all_gather

    def spy(tensor_list, tensor, *a, **k):
        sizes.append(tensor.numel() * tensor.element_size())
        return orig(tensor_list, tensor, *a, **k)

    out = {}
    dist.all_gather = spy
    try:
        for name, call in _cp_calls(rank, world, t_len, b).items():
            sizes.clear()
            with count_collectives() as calls:
                result = call()
            out[name] = (dict(calls), list(sizes), result)
    finally:
        dist.all_gather = orig
    return out


def _bits(x):
    if isinstance(x, tuple):
        return [b for item in x for b in _bits(item)]
    return [(x.dtype, x.contiguous().view(-1).view(torch.uint8))]


OFF = {"RLOPS_CP_CHECK": "0"}


@pytest.mark.parametrize(
    ("world", "t_long"), [(2, 8192), pytest.param(4, 131072, marks=pytest.mark.slow)]
)
def test_one_collective_whose_size_does_not_grow_with_t(world, t_long):
    short = run_distributed(_count, world, 64, OFF)[0]
    long = run_distributed(_count, world, t_long, OFF)[0]
    for name in short:
        calls, sizes, _ = long[name]
        assert calls == {"all_gather": 1}, (name, calls)
        assert sizes == short[name][1], (name, sizes, short[name][1])
    # bytes per rank for B=3 rows: 2 chunks x 3 rows x 5 numbers, float64, nothing else
    assert long["gae"][1] == [2 * 3 * 5 * 8]


SWITCHES = {
    "on": {},
    "RLOPS_CP_CHECK=0": {"RLOPS_CP_CHECK": "0"},
    "RLOPS_GROUP_CHECK=0": {"RLOPS_GROUP_CHECK": "0"},
}


def _count_switches(rank: int, world: int):
    out = {}
    for b in (3, 40):
        for switch, env in SWITCHES.items():
            for var in ("RLOPS_CP_CHECK", "RLOPS_GROUP_CHECK"):
                os.environ[var] = env.get(var, "1")
            out[b, switch] = _count(rank, world, 20, {}, b)
    return out


def test_the_check_rides_on_the_carries_and_changes_no_bit():
    """Check on: one collective, the fixed first exchange, where the summaries fit it (3 rows),
    two where they do not (40 rows); off (either switch): exactly the carries. Same bits."""
    ranks = run_distributed(_count_switches, 2, timeout=120)
    for (b, switch), res in ranks[0].items():
        for name, (calls, sizes, _) in res.items():
            if switch == "on":
                assert calls == {"all_gather": 1 if b == 3 else 2}, (b, name, calls)
                if b == 3:
                    assert sizes == [SLOTS * 8], (name, sizes)
            else:
                assert calls == {"all_gather": 1}, (b, switch, name, calls)
            for rank in (0, 1):
                a = _bits(ranks[rank][b, switch][name][2])
                c = _bits(ranks[rank][b, "on"][name][2])
                assert len(a) == len(c) and all(
                    x[0] == y[0] and torch.equal(x[1], y[1]) for x, y in zip(a, c, strict=True)
                ), (b, switch, name, rank)


def _pick(rank, a, b):
    return a if rank == 0 else b


def _rows(b: int, t_len: int = 8, dtype=torch.float64):
    g = torch.Generator().manual_seed(b * 100 + t_len)
    r, v = (torch.randn(b, t_len, generator=g, dtype=dtype) for _ in range(2))
    return r, v, torch.rand(b, t_len, generator=g) > 0.3


def _gae(rank, w, b=3, **kw):
    r, v, m = _rows(b, dtype=kw.pop("dtype", torch.float64))
    return rlops.gae(r, v, **{"gamma": 0.99, "lam": 0.95, "mask": m, "cp_group": w, **kw})


def _reinforce(rank, w, **kw):
    r, _, m = _rows(3)
    return rlops.reinforce_plus_plus_returns(
        r[:, 0], r, m, **{"kl_coef": 0.1, "gamma": 0.9, "cp_group": w, **kw}
    )


def _cumsum(rank, w, discount, t_len=8):
    return rlops.discounted_cumsum(_rows(3, t_len)[0], discount, cp_group=w)


def _returns(rank, w, gamma=0.9):
    r, _, m = _rows(3)
    return rlops.discounted_returns(r, gamma=gamma, mask=m, cp_group=w)


def _cp_group_on_one_rank(rank, w):
    if rank == 0:
        _gae(rank, w)
    else:  # no collective here: the mismatch shows at this rank's next call over the group
        _gae(rank, w, cp_group=None)
        _cumsum(rank, w, 0.9)


# name -> (case, what the message must contain, what it must not)
MISMATCHES = {
    "gae gamma": (
        lambda k, w: _gae(k, w, gamma=_pick(k, 0.99, 0.98)),
        ["`gamma (per-row checksum)`: [", "`gamma * lam (per-row checksum)`"],
        [],
    ),
    "gae lam": (
        lambda k, w: _gae(k, w, lam=_pick(k, 0.95, 0.9)),
        ["`gamma * lam (per-row checksum)`: ["],
        ["`gamma (per-row"],
    ),
    "gae per-row gamma, rows permuted": (
        lambda k, w: _gae(
            k,
            w,
            gamma=torch.tensor(_pick(k, [0.9, 0.8, 0.7], [0.9, 0.7, 0.8]), dtype=torch.float64),
        ),
        ["`gamma (per-row checksum)`: ["],
        [],
    ),
    "gae rows": (
        lambda k, w: _gae(k, w, b=_pick(k, 2, 3)),
        ["`rows`: [2, 3]"],
        ["payload", "checksum"],
    ),
    "gae rows, one rank's summaries beyond the first exchange": (
        lambda k, w: _gae(k, w, b=_pick(k, 2, 40)),
        ["`rows`: [2, 40]"],
        [],
    ),
    "gae dtype": (
        lambda k, w: _gae(k, w, dtype=_pick(k, torch.float32, torch.float64)),
        ["`dtype`: [torch.float32, torch.float64]"],
        ["checksum"],
    ),
    "gae method": (
        lambda k, w: _gae(k, w, method=_pick(k, "chunked", "reference")),
        ["`method`: ['chunked', 'reference']"],
        [],
    ),
    "gae vs reinforce_plus_plus_returns": (
        lambda k, w: (_gae if k == 0 else _reinforce)(k, w),
        ["`function`: ['gae', 'reinforce_plus_plus_returns']"],
        ["rows", "kl_coef"],
    ),
    "discounted_returns vs discounted_cumsum": (
        lambda k, w: _returns(k, w) if k == 0 else _cumsum(k, w, 0.9),
        ["`function`: ['discounted_returns', 'discounted_cumsum']"],
        [],
    ),
    "discounted_returns gamma": (
        lambda k, w: _returns(k, w, gamma=_pick(k, 0.9, 0.8)),
        ["`gamma`: [0.9, 0.8]"],
        [],
    ),
    "reinforce_plus_plus_returns kl_coef": (
        lambda k, w: _reinforce(k, w, kl_coef=_pick(k, 0.1, 0.2)),
        ["`kl_coef`: [0.1, 0.2]"],
        [],
    ),
    "reinforce_plus_plus_returns gamma": (
        lambda k, w: _reinforce(k, w, gamma=_pick(k, 0.9, 1.0)),
        ["`gamma (per-row checksum)`: ["],
        [],
    ),
    "discounted_cumsum discount": (
        lambda k, w: _cumsum(k, w, _pick(k, 0.9, 0.8)),
        ["`discount`: [0.9, 0.8]"],
        [],
    ),
    "discounted_cumsum per-row discount": (
        lambda k, w: _cumsum(k, w, torch.full((3, 1), _pick(k, 0.9, 0.8))),
        ["`discount (per-row checksum)`: ["],
        [],
    ),
    "discounted_cumsum scalar vs per-token discount": (
        lambda k, w: _cumsum(k, w, _pick(k, 0.9, torch.full((3, 8), 0.9))),
        ["`discount form`: ['scalar', 'per token']"],
        ["`discount`"],
    ),
    "discounted_cumsum local length": (
        lambda k, w: _cumsum(k, w, 0.9, t_len=_pick(k, 16, 24)),
        ["`local length`: [16, 24]"],
        [],
    ),
    "cp_group on one rank only": (
        _cp_group_on_one_rank,
        ["`function`: ['gae', 'discounted_cumsum']"],
        [],
    ),
}


def _mismatch_work(rank: int, world: int):
    w = dist.group.WORLD
    out = {}
    for name, (case, _, _) in MISMATCHES.items():
        try:
            case(rank, w)
        except ValueError as e:
            out[name] = str(e)
        else:
            out[name] = None
    # the group is still in step: a matching call afterwards gives the whole batch's result
    r, v, m = _rows(3, 16)
    shard = lambda x: zigzag_shard(x, cp_size=world, cp_rank=rank)  # noqa: E731
    adv, _ = rlops.gae(shard(r), shard(v), gamma=0.99, lam=0.95, mask=shard(m), cp_group=w)
    out["after"] = zigzag_unshard(adv, group=w, length=16)
    return out


def test_mismatched_calls_raise_the_same_error_on_every_rank():
    """Each mismatch raises on both ranks at once (a hang would end in run_distributed's
    timeout), with one message naming the argument and each rank's value."""
    ranks = run_distributed(_mismatch_work, 2, timeout=90)
    for name, (_, expected, absent) in MISMATCHES.items():
        msgs = [res[name] for res in ranks]
        assert msgs[0] is not None and msgs[1] is not None, (name, msgs)
        assert msgs[0] == msgs[1], (name, msgs)
        assert msgs[0].startswith("the ranks of a process group disagree on "), msgs[0]
        for part in expected:
            assert part in msgs[0], (name, part, msgs[0])
        for part in absent:
            assert part not in msgs[0], (name, part, msgs[0])
    r, v, m = _rows(3, 16)
    want, _ = rlops.gae(r, v, gamma=0.99, lam=0.95, mask=m, method="reference")
    for res in ranks:
        torch.testing.assert_close(res["after"], want, rtol=1e-12, atol=1e-12)


def test_odd_local_length_is_rejected_without_a_collective():
    with pytest.raises(ValueError, match="two zigzag chunks"):
        from rlops.advantages.context_parallel import Layout, cp_scan

        cp_scan(torch.zeros(1, 3), 0.5, Layout(None), "chunked")


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
