"""Context-parallel scans in both layouts (``cp_layout="zigzag" | "contiguous"``) and with the
truncation bootstrap, on real Gloo groups of 2 and 4 ranks: each rank's shard of every result
equals the one-process computation on the whole (padded) row, with one collective per call;
plus the layout helpers in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed
from tests.oracles import discounted_returns_bootstrap_oracle, gae_bootstrap_oracle

import rlops
from rlops.distributed import (
    contiguous_indices,
    contiguous_shard,
    contiguous_unshard,
    cp_indices,
    cp_shard,
    cp_unshard,
    zigzag_indices,
    zigzag_shard,
)
from rlops.distributed.layout import holds_row_end, rank_chunks

LAYOUTS = ("zigzag", "contiguous")


def _padded(t_len, world, layout):
    unit = 2 * world if layout == "zigzag" else world
    return -(-t_len // unit) * unit


def _batch(t_len, seed, b=3):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(b, t_len, generator=g, dtype=torch.float64)
    v = torch.randn(b, t_len, generator=g, dtype=torch.float64)
    m = torch.rand(b, t_len, generator=g) > 0.3
    m[:, t_len // 3 : t_len // 2] = False  # a tool span
    m[-1] = False  # a row with no action token
    d = torch.rand(b, t_len, generator=g) > 0.9
    tr = torch.rand(b, t_len, generator=g) > 0.9
    tr[0, -1] = True
    boot_t = torch.randn(b, t_len, generator=g, dtype=torch.float64)
    boot_t[~tr] = float("nan")  # never read
    boot_r = torch.randn(b, generator=g, dtype=torch.float64)
    kl = torch.randn(b, t_len, generator=g, dtype=torch.float64)
    outcome = torch.randn(b, generator=g, dtype=torch.float64)
    decay = torch.rand(b, t_len, generator=g, dtype=torch.float64)
    return r, v, m, d, tr, boot_t, boot_r, kl, outcome, decay


def _pad(x, length):
    return torch.nn.functional.pad(x, (0, length - x.shape[-1])) if x.dim() == 2 else x


def _calls(rank, world, layout, t_len, method):
    """(name, single-process result on the padded row, this rank's CP result) for every CP
    function and both bootstrap forms."""
    r, v, m, d, tr, boot_t, boot_r, kl, outcome, decay = _batch(t_len, seed=t_len)
    p = _padded(t_len, world, layout)
    r, v, m, d, tr, boot_t, kl, decay = (_pad(x, p) for x in (r, v, m, d, tr, boot_t, kl, decay))
    w = dist.group.WORLD

    def sh(x):
        return cp_shard(x, cp_size=world, cp_rank=rank, layout=layout)

    cp = dict(cp_group=w, cp_layout=layout, method=method)
    out = []
    for name, kw, kw_local in (
        ("plain", {}, {}),
        ("row bootstrap", dict(bootstrap=boot_r), dict(bootstrap=boot_r)),
        ("token bootstrap", dict(bootstrap=boot_t, truncated=tr),
         dict(bootstrap=sh(boot_t), truncated=sh(tr))),
    ):  # fmt: skip
        want = rlops.gae(r, v, gamma=0.99, lam=0.95, mask=m, dones=d, method="reference", **kw)
        got = rlops.gae(sh(r), sh(v), gamma=0.99, lam=0.95, mask=sh(m), dones=sh(d), **cp,
                        **kw_local)  # fmt: skip
        out += [(f"gae {name} advantages", want[0], got[0]), (f"gae {name}", want[1], got[1])]
        want = rlops.discounted_returns(r, gamma=0.9, mask=m, dones=d, method="reference", **kw)
        got = rlops.discounted_returns(sh(r), gamma=0.9, mask=sh(m), dones=sh(d), **cp,
                                       **kw_local)  # fmt: skip
        out.append((f"returns {name}", want, got))
    # no mask, per-row discounts, a row bootstrap (the padding is action tokens here, as in
    # the padded single-process row)
    g_rows = torch.tensor([0.5, 1.0, 0.9], dtype=torch.float64)
    want = rlops.gae(r, v, gamma=g_rows, lam=1.0, bootstrap=boot_r, method="reference")
    got = rlops.gae(sh(r), sh(v), gamma=g_rows, lam=1.0, bootstrap=boot_r, **cp)
    out += [("gae no mask", want[0], got[0])]
    want = rlops.reinforce_plus_plus_returns(outcome, kl, m, kl_coef=0.1, gamma=0.95,
                                             method="reference")  # fmt: skip
    got = rlops.reinforce_plus_plus_returns(outcome, sh(kl), sh(m), kl_coef=0.1, gamma=0.95,
                                            **cp)  # fmt: skip
    out.append(("reinforce++", want, got))
    for disc in (0.97, decay, 0.0, 1.0):
        want = rlops.discounted_cumsum(r, disc, method="reference")
        got = rlops.discounted_cumsum(sh(r), sh(disc) if disc is decay else disc, **cp)
        out.append((f"cumsum {disc if isinstance(disc, float) else 'per token'}", want, got))
    return [(name, sh(want), got) for name, want, got in out]


def _work(rank, world, lengths, methods):
    errors = {}
    counts = set()
    for layout in LAYOUTS:
        for t_len in lengths:
            for method in methods:
                with count_collectives() as calls:
                    cases = _calls(rank, world, layout, t_len, method)
                counts.add(sum(calls.values()) / 12)  # 12 CP calls in _calls, one each
                for name, want, got in cases:
                    key = f"{layout} T={t_len} {method} {name}"
                    errors[key] = (got - want).abs().max().item() if want.numel() else 0.0
    # the oracle, in the contiguous layout, with the bootstrap written plainly
    r, v, m, d, tr, boot_t, boot_r, *_ = _batch(37, seed=5)
    p = _padded(37, world, "contiguous")
    w = dist.group.WORLD

    def sh(x):
        return contiguous_shard(_pad(x, p), cp_size=world, cp_rank=rank)

    adv, _ = rlops.gae(sh(r), sh(v), gamma=0.9, lam=0.8, mask=sh(m), dones=sh(d),
                       bootstrap=sh(boot_t), truncated=sh(tr), cp_group=w,
                       cp_layout="contiguous")  # fmt: skip
    adv = contiguous_unshard(adv, group=w, length=37)
    want, _ = gae_bootstrap_oracle(r, v, 0.9, 0.8, m, d, boot_t, tr)
    errors["oracle gae token bootstrap"] = (adv - want).abs().max().item()
    g = rlops.discounted_returns(sh(r), gamma=0.9, mask=sh(m), bootstrap=boot_r, cp_group=w,
                                 cp_layout="contiguous")  # fmt: skip
    g = contiguous_unshard(g, group=w, length=37)
    want = discounted_returns_bootstrap_oracle(r, 0.9, m, None, boot_r, None)
    errors["oracle returns row bootstrap"] = (g - want).abs().max().item()
    return errors, counts, _mismatch(rank), _fits(rank, world)


def _fits(rank, world):
    """Collectives of a GAE call by rows: the summaries ride in the checked first exchange
    while they fit (docs: 6 rows in zigzag, 5 with a per-row bootstrap, 12 in contiguous)."""
    w = dist.group.WORLD
    out = {}
    for layout, rows, boot in (("zigzag", 6, False), ("zigzag", 7, False), ("zigzag", 5, True),
                               ("zigzag", 6, True), ("contiguous", 12, False),
                               ("contiguous", 13, False)):  # fmt: skip
        x = torch.zeros(rows, 4 * world, dtype=torch.float64)
        local = cp_shard(x, cp_size=world, cp_rank=rank, layout=layout)
        kw = dict(bootstrap=torch.ones(rows, dtype=torch.float64)) if boot else {}
        with count_collectives() as calls:
            rlops.gae(local, local, gamma=0.9, lam=0.9, cp_group=w, cp_layout=layout, **kw)
        out[(layout, rows, boot)] = sum(calls.values())
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_both_layouts_and_the_bootstrap_equal_one_process(world):
    lengths = (1, 5, 8, 130) if world == 2 else (37,)
    methods = ("reference", "chunked", "compiled") if world == 2 else ("auto",)
    results = run_distributed(_work, world, lengths, methods, timeout=240)
    fits = {
        ("zigzag", 6, False): 1,
        ("zigzag", 7, False): 2,
        ("zigzag", 5, True): 1,
        ("zigzag", 6, True): 2,
        ("contiguous", 12, False): 1,
        ("contiguous", 13, False): 2,
    }
    for errors, counts, _, collectives in results:
        assert collectives == fits, collectives
        bad = {k: e for k, e in errors.items() if not e <= 1e-12}
        assert not bad, bad
        assert counts == {1.0}, counts  # one collective per call (3 rows fit the first one)
    # ranks called with different layouts all raise the same error naming cp_layout
    msgs = [res[2] for res in results]
    assert len(set(msgs)) == 1 and "`cp_layout`" in msgs[0], msgs


def _mismatch(rank):
    x = torch.zeros(1, 4, dtype=torch.float64)
    layout = "zigzag" if rank == 0 else "contiguous"
    try:
        rlops.discounted_cumsum(x, 0.5, cp_group=dist.group.WORLD, cp_layout=layout)
    except ValueError as e:
        return str(e)
    return None


# ------------------------------------------------------------------ helpers, one process


def test_layout_helpers():
    assert rank_chunks("zigzag", 3, 1) == (1, 4)
    assert rank_chunks("contiguous", 3, 1) == (1,)
    assert [holds_row_end("zigzag", 3, k) for k in range(3)] == [True, False, False]
    assert [holds_row_end("contiguous", 3, k) for k in range(3)] == [False, False, True]
    # contiguous: rank r holds positions [r * L, (r + 1) * L) of the sequence padded to cp * L
    assert contiguous_indices(7, cp_size=3, cp_rank=2).tolist() == [6, 7, 8]
    assert cp_indices(8, cp_size=2, cp_rank=0, layout="zigzag").tolist() == [0, 1, 6, 7]
    assert torch.equal(cp_indices(8, cp_size=2, cp_rank=1), zigzag_indices(8, cp_size=2, cp_rank=1))
    x = torch.arange(2 * 13).reshape(2, 13)
    for layout in LAYOUTS:
        for world in (1, 2, 3, 4):
            shards = [cp_shard(x, cp_size=world, cp_rank=k, layout=layout) for k in range(world)]
            assert len({s.shape for s in shards}) == 1
            pos = torch.cat(
                [cp_indices(13, cp_size=world, cp_rank=k, layout=layout) for k in range(world)]
            )
            assert sorted(pos.tolist()) == list(range(shards[0].shape[-1] * world))
            for k, s in enumerate(shards):
                idx = cp_indices(13, cp_size=world, cp_rank=k, layout=layout)
                want = torch.where(idx < 13, x[:, idx.clamp(max=12)], 0)
                assert torch.equal(s, want)
    assert torch.equal(
        cp_shard(x, cp_size=3, cp_rank=1, layout="zigzag"), zigzag_shard(x, cp_size=3, cp_rank=1)
    )
    s = contiguous_shard(x, cp_size=1, cp_rank=0)
    assert torch.equal(cp_unshard(s, group=None, length=13, layout="contiguous"), x)
    with pytest.raises(ValueError, match="cp_layout must be one of"):
        cp_shard(x, cp_size=2, cp_rank=0, layout="ring")
    with pytest.raises(ValueError, match="cp_rank"):
        contiguous_shard(x, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="cp_layout must be one of"):
        rlops.discounted_cumsum(x.double(), 0.5, cp_layout="ring")
    with pytest.raises(ValueError, match="cp_layout must be one of"):
        rlops.reinforce_plus_plus_returns(torch.zeros(2), torch.zeros(2, 4),
                                          torch.ones(2, 4), kl_coef=0.1, gamma=1.0,
                                          cp_layout=None)  # fmt: skip
