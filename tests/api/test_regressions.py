"""Reproducers of bugs that were fixed: each of these inputs once gave a wrong result or a
confusing error.

* NaN or inf beyond a ``done`` (or beyond an exact-0 discount) must not reach the tokens before
  it, for any method, at any position relative to the chunks, and under context parallelism.
* Context-parallel calls whose ranks pass different scalar parameters raise ``ValueError`` on
  every rank (instead of returning a result that matches no rank's call).
* Scalar parameters accept numpy scalars and 0-dim tensors and give the result of the same
  Python float.
* Bad arguments raise errors that name them.
* The default CPU path in float32 is as accurate on 128K-token rows as the chunked method.
* A NaN or an infinity reaches only the steps at or before it (the chunked scan's matmul once
  put ``0 · NaN`` on later steps of its chunk), with the loop's NaN / ±inf pattern.

A bug that is not fixed yet is reproduced by a case marked ``xfail(strict=True)`` whose reason
says what goes wrong; the mark goes when the fix lands (strict: an unexpected pass fails).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tests._distributed import run_distributed
from tests.oracles import discounted_returns_oracle, gae_oracle
from tests.tolerances import ALL_METHODS, METHODS, max_abs_err, needs_numba

import rlops
from rlops.compat.slime import zigzag_unshard_response
from rlops.distributed import zigzag_shard, zigzag_unshard
from rlops.scan.reference import scan_reference

NAN, INF = math.nan, math.inf
POISONS = [NAN, INF, -INF]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------- nothing crosses a cut
def _estimators(r, v, mask, dones, method, chunk_size=None):
    """Every output of gae and discounted_returns on one batch, as a list of [B, T] tensors."""
    adv, ret = rlops.gae(
        r, v, gamma=0.9, lam=0.95, mask=mask, dones=dones, method=method, chunk_size=chunk_size
    )
    g = rlops.discounted_returns(
        r, gamma=0.9, mask=mask, dones=dones, method=method, chunk_size=chunk_size
    )
    return [adv, ret, g]


def _assert_prefix_untouched(name, poisoned, clean, end):
    """Entries ``[:, :end]`` are finite and identical to those computed from clean inputs: what
    lies beyond the cut contributes nothing, not even a rounding."""
    for k, (p, c) in enumerate(zip(poisoned, clean, strict=True)):
        assert torch.isfinite(p[:, :end]).all(), f"{name} output {k}: {p[:, :end]}"
        assert torch.equal(p[:, :end], c[:, :end]), f"{name} output {k} differs before the cut"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("with_mask", [False, True])
def test_nan_does_not_cross_a_done(method, poison, with_mask):
    r = torch.randn(2, 8, generator=_gen(1))
    v = torch.randn(2, 8, generator=_gen(2))
    d = torch.zeros(2, 8, dtype=torch.bool)
    d[:, 3] = True
    mask = None
    if with_mask:
        mask = torch.ones(2, 8, dtype=torch.bool)
        mask[:, 1] = False  # an interior tool span before the done
        mask[0, 5] = False  # and one after it
    clean = _estimators(r, v, mask, d, method)
    bad_r, bad_v = r.clone(), v.clone()
    bad_r[:, 6] = poison
    got = _estimators(bad_r, v, mask, d, method)
    _assert_prefix_untouched(f"rewards[:, 6] = {poison}", got, clean, 4)
    bad_v[:, 4:] = poison  # values beyond the done: no bootstrap through it
    got = _estimators(r, bad_v, mask, d, method)
    _assert_prefix_untouched(f"values[:, 4:] = {poison}", got, clean, 4)
    got = _estimators(bad_r, bad_v, mask, d, method)
    _assert_prefix_untouched("both", got, clean, 4)


# Dones at the last and the first step of a chunk and inside one, for chunk sizes 16 (the
# per-token default), 64 and 100 (which does not divide T). Only "chunked" has chunks: the
# other methods run one done position.
LONG_T = 1000
DONE_AT = [511, 512, 500, 99, 100]
CHUNK_SIZES = [None, 16, 64, 100]


def _long_rows():
    gen = _gen(3)
    r = torch.randn(3, LONG_T, generator=gen, dtype=torch.float64)
    v = torch.randn(3, LONG_T, generator=gen, dtype=torch.float64)
    mask = torch.rand(3, LONG_T, generator=gen) > 0.2
    mask[:, 300:340] = False
    return r, v, mask


@pytest.mark.parametrize("method", METHODS)
def test_nan_does_not_cross_a_done_in_long_rows(method):
    r, v, mask = _long_rows()
    chunked = method == "chunked"
    failures = []
    for chunk_size in CHUNK_SIZES if chunked else [None]:
        for done_at in DONE_AT if chunked else DONE_AT[:1]:
            for m in (None, mask):
                d = torch.zeros(3, LONG_T, dtype=torch.bool)
                d[:, done_at] = True
                bad_r, bad_v = r.clone(), v.clone()
                bad_r[0, done_at + 1] = NAN
                bad_r[1, -1] = INF
                bad_r[2, done_at + 1 :: 7] = NAN
                bad_v[:, done_at + 1 :] = NAN
                clean = _estimators(r, v, m, d, method, chunk_size)
                got = _estimators(bad_r, bad_v, m, d, method, chunk_size)
                try:
                    _assert_prefix_untouched(f"done at {done_at}", got, clean, done_at + 1)
                except AssertionError as e:
                    failures.append(f"chunk_size={chunk_size} mask={m is not None}: {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("poison", POISONS)
def test_nan_does_not_cross_a_zero_discount(method, poison):
    x = torch.randn(2, 8, generator=_gen(4))
    a = torch.full((2, 8), 0.9)
    a[:, 3] = 0.0
    bad = x.clone()
    bad[:, 6] = poison
    y = rlops.discounted_cumsum(bad, a, method=method)
    assert torch.isfinite(y[:, :4]).all(), y
    assert torch.equal(y[:, :4], rlops.discounted_cumsum(x, a, method=method)[:, :4])
    # a per-row discount of exactly 0: that row is x itself (NaN stays where it is)
    y = rlops.discounted_cumsum(bad, torch.tensor([[0.0], [0.9]]), method=method)
    assert _same(y[0], bad[0]), y
    # the scalar discount 0.0: y = x
    assert _same(rlops.discounted_cumsum(bad, 0.0, method=method), bad)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal elementwise, NaN matching NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("method", METHODS)
def test_zero_discount_cuts_in_long_rows(method):
    gen = _gen(5)
    x = torch.randn(2, LONG_T, generator=gen, dtype=torch.float64)
    a = torch.rand(2, LONG_T, generator=gen, dtype=torch.float64) * 0.2 + 0.8
    chunked = method == "chunked"
    for chunk_size in [*CHUNK_SIZES, 2] if chunked else [None]:
        for cut in DONE_AT if chunked else DONE_AT[:1]:
            ac = a.clone()
            ac[:, cut] = 0.0
            bad = x.clone()
            bad[0, cut + 1] = NAN
            bad[1, cut + 1 :: 5] = INF
            y = rlops.discounted_cumsum(bad, ac, method=method, chunk_size=chunk_size)
            want = rlops.discounted_cumsum(x, ac, method=method, chunk_size=chunk_size)
            where = f"chunk_size={chunk_size}, cut at {cut}"
            assert torch.isfinite(y[:, : cut + 1]).all(), where
            assert torch.equal(y[:, : cut + 1], want[:, : cut + 1]), where


@pytest.mark.parametrize(
    "method",
    [
        "reference",
        "chunked",  # the chunk matmul's 0 · NaN above its diagonal once reached later steps
        pytest.param("compiled", marks=needs_numba),
    ],
)
@pytest.mark.parametrize("discount", ["scalar", "row"])
def test_nan_reaches_no_later_step(method, discount):
    """``y[t]`` depends on ``x[k]`` for ``k >= t`` only: a NaN at step 6 cannot reach step 7."""
    x = torch.randn(2, 8, generator=_gen(6))
    x[:, 6] = NAN
    a = 0.9 if discount == "scalar" else torch.tensor([[0.9], [0.5]])
    y = rlops.discounted_cumsum(x, a, method=method)
    assert torch.equal(y[:, 7], x[:, 7]), y
    adv, _ = rlops.gae(x, torch.zeros(2, 8), gamma=0.9, lam=0.95, method=method)
    assert torch.isfinite(adv[:, 7]).all(), adv


# ----------------------------------------------------------------- context parallel (Gloo)
def _cp_worker(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    out: dict = {}

    def shard(x):
        return zigzag_shard(x, cp_size=world, cp_rank=rank)

    # 1. NaN beyond a cut (T = 12: each rank holds two chunks of 3)
    t_len = 12
    x = torch.randn(2, t_len, generator=_gen(7), dtype=torch.float64)
    x[:, 6] = NAN
    a = torch.full((2, t_len), 0.9, dtype=torch.float64)
    a[:, 3] = 0.0
    finite = {}
    for method in ALL_METHODS:
        y = rlops.discounted_cumsum(shard(x), shard(a), method=method, cp_group=group)
        finite[f"cumsum {method}"] = zigzag_unshard(y, group=group, length=t_len)
        d = torch.zeros(2, t_len, dtype=torch.bool)
        d[:, 3] = True
        v = torch.randn(2, t_len, generator=_gen(8), dtype=torch.float64)
        v[:, 4:] = NAN
        adv, ret = rlops.gae(
            shard(x), shard(v), gamma=0.9, lam=0.95, dones=shard(d), method=method, cp_group=group
        )
        finite[f"gae adv {method}"] = zigzag_unshard(adv, group=group, length=t_len)
        finite[f"gae ret {method}"] = zigzag_unshard(ret, group=group, length=t_len)
        g = rlops.discounted_returns(
            shard(x), gamma=0.9, dones=shard(d), method=method, cp_group=group
        )
        finite[f"returns {method}"] = zigzag_unshard(g, group=group, length=t_len)
    out["nan"] = finite
    # a per-row discount of exactly 0 (row 0) and the scalar 0.0: y = x, NaN where it was
    zero = {}
    for method in ALL_METHODS:
        y = rlops.discounted_cumsum(
            shard(x),
            torch.tensor([[0.0], [0.9]], dtype=torch.float64),
            method=method,
            cp_group=group,
        )
        zero[f"per-row 0 {method}"] = zigzag_unshard(y, group=group, length=t_len)[:1]
        y = rlops.discounted_cumsum(shard(x), 0.0, method=method, cp_group=group)
        zero[f"scalar 0 {method}"] = zigzag_unshard(y, group=group, length=t_len)
    out["zero"], out["x"] = zero, x

    # 2. each case passes a parameter that differs between the ranks
    t_len = 8
    r = torch.randn(2, t_len, generator=_gen(9))
    m = torch.ones(2, t_len, dtype=torch.bool)
    m[:, 2:4] = False
    kl = torch.randn(2, t_len, generator=_gen(10))
    mine = 0.99 if rank == 0 else 0.98
    rows = torch.tensor([0.9, mine])
    sr, sm, skl = shard(r), shard(m), shard(kl)
    cases = {
        "gae gamma": lambda: rlops.gae(sr, sr, gamma=mine, lam=0.95, cp_group=group),
        "gae lam": lambda: rlops.gae(sr, sr, gamma=0.99, lam=mine, cp_group=group),
        "gae per-row gamma": lambda: rlops.gae(sr, sr, gamma=rows, lam=0.95, cp_group=group),
        "gae gamma with mask": lambda: rlops.gae(
            sr, sr, gamma=mine, lam=0.95, mask=sm, cp_group=group
        ),
        "returns gamma": lambda: rlops.discounted_returns(sr, gamma=mine, cp_group=group),
        "returns per-row gamma": lambda: rlops.discounted_returns(sr, gamma=rows, cp_group=group),
        "returns gamma with mask": lambda: rlops.discounted_returns(
            sr, gamma=mine, mask=sm, cp_group=group
        ),
        "reinforce++ gamma": lambda: rlops.reinforce_plus_plus_returns(
            r[:, 0], skl, sm, kl_coef=0.1, gamma=mine, cp_group=group
        ),
        "reinforce++ kl_coef": lambda: rlops.reinforce_plus_plus_returns(
            r[:, 0], skl, sm, kl_coef=mine, gamma=1.0, cp_group=group
        ),
        "cumsum per-row discount": lambda: rlops.discounted_cumsum(
            sr, rows[:, None], cp_group=group
        ),
        "cumsum scalar discount": lambda: rlops.discounted_cumsum(sr, mine, cp_group=group),
    }
    raised = {}
    for name, call in cases.items():
        try:
            call()
            raised[name] = None
        except Exception as e:  # reported to the parent, which checks the type and message
            raised[name] = (type(e).__name__, str(e))
    out["mismatch"] = raised
    # the group still works after every case (no rank left behind in a collective)
    out["after"] = zigzag_unshard_response(
        torch.ones(1, 4), group=group, total_length=8, response_length=3
    )
    return out


@functools.cache
def _cp_results() -> list[dict]:
    return run_distributed(_cp_worker, 2, timeout=120)


@pytest.mark.distributed
def test_context_parallel_nan_does_not_cross_a_cut():
    for rank, res in enumerate(_cp_results()):
        for name, full in res["nan"].items():
            assert torch.isfinite(full[:, :4]).all(), (rank, name, full)
        assert torch.equal(res["after"], torch.ones(1, 3))
        for name, y in res["zero"].items():
            assert _same(y, res["x"][: y.shape[0]]), (rank, name, y)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case",
    [
        "gae gamma",
        "gae lam",
        "gae per-row gamma",
        "gae gamma with mask",
        "returns gamma",
        "returns per-row gamma",
        "returns gamma with mask",
        "reinforce++ gamma",
        "reinforce++ kl_coef",
        "cumsum per-row discount",
        "cumsum scalar discount",
    ],
)
def test_context_parallel_mismatched_parameter_raises_on_every_rank(case):
    for rank, res in enumerate(_cp_results()):
        got = res["mismatch"][case]
        assert got is not None, f"rank {rank}: {case} returned instead of raising"
        kind, msg = got
        assert kind == "ValueError" and "disagree" in msg, (rank, kind, msg)


# ----------------------------------------------------------------- numpy and 0-dim scalars
FORMS = {
    "numpy float32": np.float32,
    "numpy float64": np.float64,
    "0-dim float32 tensor": lambda v: torch.tensor(v, dtype=torch.float32),
    "0-dim float64 tensor": lambda v: torch.tensor(v, dtype=torch.float64),
}


def _batch():
    gen = _gen(11)
    r = torch.randn(3, 10, generator=gen)
    v = torch.randn(3, 10, generator=gen)
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[:, 4:6] = False
    mask[1, 8:] = False
    return r, v, mask


def _call(name: str, value):
    r, v, mask = _batch()
    old = r + 0.3 * v
    index = torch.tensor([0, 0, 1])
    calls = {
        "gae gamma": lambda: rlops.gae(r, v, gamma=value, lam=0.95, mask=mask),
        "gae lam": lambda: rlops.gae(r, v, gamma=0.99, lam=value, mask=mask),
        "discounted_returns gamma": lambda: rlops.discounted_returns(r, gamma=value, mask=mask),
        "reinforce++ kl_coef": lambda: rlops.reinforce_plus_plus_returns(
            r[:, 0], v, mask, kl_coef=value, gamma=0.99
        ),
        "policy_loss clip_low": lambda: rlops.policy_loss(r, old, v, mask, clip_low=value),
        "policy_loss clip_high": lambda: rlops.policy_loss(r, old, v, mask, clip_high=value),
        "policy_loss dual_clip": lambda: rlops.policy_loss(r, old, v, mask, dual_clip=value + 2),
        "value_loss clip": lambda: rlops.value_loss(r, old, v, mask, clip=value),
        "grpo_advantages eps": lambda: rlops.grpo_advantages(r[:, 0], index, mask, eps=value),
        "masked_whiten eps": lambda: rlops.masked_whiten(r, mask, eps=value),
    }
    return calls[name]()


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [out[k] for k in sorted(out)]
    return [t for part in out for t in _flat(part)]


SCALAR_PARAMS = [
    "gae gamma",
    "gae lam",
    "discounted_returns gamma",
    "reinforce++ kl_coef",
    "policy_loss clip_low",
    "policy_loss clip_high",
    "policy_loss dual_clip",
    "value_loss clip",
    "grpo_advantages eps",
    "masked_whiten eps",
]


@pytest.mark.parametrize(
    "name, form",
    [(name, form) for name in SCALAR_PARAMS for form in FORMS],
)
def test_numpy_and_zero_dim_scalars_equal_python_floats(name, form):
    value = 0.1 if "eps" in name else 0.3 if "clip" in name or "kl" in name else 0.9
    scalar = FORMS[form](value)
    want = _flat(_call(name, float(scalar)))  # the same number as a Python float
    got = _flat(_call(name, scalar))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        assert torch.equal(g, w), f"max difference {(g - w).abs().max().item():.3g}"


# ----------------------------------------------------------------- clear errors
def test_policy_loss_clip_low_of_one_or_more():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"\bclip_low\b"):
        rlops.policy_loss(x, x, x, torch.ones(2, 3), clip_low=1.5)


@pytest.mark.parametrize(
    "shape",
    [
        (2, 5),
        (3, 4),
        (2,),
        (2, 4, 1),
    ],
)
def test_reinforce_plus_plus_misshaped_kl_names_kl(shape):
    mask = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"\bkl\b"):
        rlops.reinforce_plus_plus_returns(
            torch.ones(2), torch.zeros(shape), mask, kl_coef=0.1, gamma=1.0
        )


def test_policy_loss_mask_on_another_device_names_mask():
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"\bmask\b"):
        rlops.policy_loss(x, x, x, mask)


def test_zigzag_shard_of_a_list():
    with pytest.raises(TypeError):
        rlops.distributed.zigzag_shard([1, 2, 3], cp_size=2, cp_rank=0)


def test_zigzag_unshard_group_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"\bgroup\b"):
        rlops.distributed.zigzag_unshard(torch.zeros(4), group="x", length=4)


def test_cp_group_is_checked_before_the_local_length():
    x = torch.zeros(1, 3)  # an odd local length: not two zigzag chunks
    with pytest.raises(TypeError, match=r"\bcp_group\b"):
        rlops.gae(x, x, gamma=1.0, lam=1.0, cp_group="x")


# ----------------------------------------------------------------- float32 on long rows
@functools.cache
def _long_gae(gamma: float, lam: float):
    gen = _gen(12)
    r = torch.randn(2, 131072, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 131072, generator=gen, dtype=torch.float64)
    return r, v, gae_oracle(r, v, gamma, lam)


@pytest.mark.slow
@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (1.0, 1.0)])
def test_float32_gae_default_path_on_long_rows(gamma, lam):
    r, v, oracle = _long_gae(gamma, lam)
    r32, v32 = r.float(), v.float()
    chunked = rlops.gae(r32, v32, gamma=gamma, lam=lam, method="chunked")
    budget = [max_abs_err(out, want) for out, want in zip(chunked, oracle, strict=True)]
    for method in [m for m in ALL_METHODS if m in ("auto", "compiled")]:
        got = rlops.gae(r32, v32, gamma=gamma, lam=lam, method=method)
        errs = [max_abs_err(out, want) for out, want in zip(got, oracle, strict=True)]
        print(
            f"gae T=131072 gamma={gamma} lam={lam}: {method} errors (adv, ret) "
            f"{errs[0]:.3g}, {errs[1]:.3g}; chunked {budget[0]:.3g}, {budget[1]:.3g}"
        )
        assert errs[0] <= budget[0] and errs[1] <= budget[1], (method, errs, budget)


@pytest.mark.slow
def test_float32_discounted_returns_default_path_on_long_rows():
    r = torch.randn(2, 32768, generator=_gen(13), dtype=torch.float64)
    oracle = discounted_returns_oracle(r, 0.999)
    budget = max_abs_err(rlops.discounted_returns(r.float(), gamma=0.999, method="chunked"), oracle)
    for method in [m for m in ALL_METHODS if m in ("auto", "compiled")]:
        err = max_abs_err(rlops.discounted_returns(r.float(), gamma=0.999, method=method), oracle)
        print(
            f"discounted_returns T=32768 gamma=0.999: {method} error {err:.3g}; "
            f"chunked {budget:.3g}"
        )
        assert err <= budget, (method, err, budget)


@pytest.mark.parametrize("method", ["reference", "chunked", "compiled", "auto"])
def test_zero_gamma_or_lam_is_an_exact_cut_in_the_estimators(method):
    """gamma = 0 (or lam = 0 for the advantage) links nothing: NaN later in the row stays there."""
    if method == "compiled":
        pytest.importorskip("numba")
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    x[:, 5] = float("nan")
    zeros = torch.zeros(2, 8)
    assert torch.equal(rlops.discounted_returns(x, gamma=0.0, method=method)[:, :5], x[:, :5])
    per_row = rlops.discounted_returns(x, gamma=torch.tensor([0.0, 0.5]), method=method)
    assert torch.equal(per_row[0, :5], x[0, :5])
    adv = rlops.gae(x, zeros, gamma=0.0, lam=0.9, method=method)[0]
    assert torch.equal(adv[:, :5], x[:, :5])  # delta = r with V = 0
    adv = rlops.gae(x, zeros, gamma=0.9, lam=0.0, method=method)[0]
    assert torch.isfinite(adv[:, :4]).all()  # delta[4] = r[4] + 0.9 * V[5] = r[4]: finite too


@pytest.mark.parametrize("discount", ["scalar", "row"])
@pytest.mark.parametrize("t_len", [1, 63, 64, 65, 129, 1000])
def test_infinities_and_nan_reach_the_steps_the_loop_reaches(discount, t_len):
    """The chunked scan against the loop on rows holding NaN, +inf and -inf at chunk edges:
    the same non-finite pattern (a NaN, or both infinities, at or after a step make it NaN;
    one infinity makes it that infinity), and the finite steps within the float32 rule."""
    g = _gen(t_len)
    x = torch.randn(3, t_len, generator=g)
    for row, (k, v) in enumerate([(t_len - 1, NAN), (t_len // 2, INF), (min(64, t_len - 1), -INF)]):
        x[row, k] = v
    x[2, 0] = INF  # row 2: both infinities when t_len > 1
    a = 0.9 if discount == "scalar" else torch.tensor([[0.9], [0.5], [1.0]])
    want = scan_reference(x.double(), a if discount == "scalar" else a.double().expand(3, t_len))
    got = rlops.discounted_cumsum(x, a, method="chunked")
    for pattern in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(pattern(got), pattern(want)), pattern.__name__
    # finite steps: within twice the float32 loop's error plus a few ulps (the tests' rule)
    finite = torch.isfinite(want)
    loop32 = scan_reference(x, a if discount == "scalar" else a.expand(3, t_len))
    zero = torch.zeros(1, dtype=torch.float64)
    err = torch.cat([zero, (got.double() - want)[finite].abs()]).max()
    err_loop = torch.cat([zero, (loop32.double() - want)[finite].abs()]).max()
    scale = torch.cat([zero + 1, want[finite].abs()]).max()
    assert err <= 2 * err_loop + 4 * torch.finfo(torch.float32).eps * scale, (err, err_loop)
