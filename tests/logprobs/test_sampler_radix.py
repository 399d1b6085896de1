"""The sampler's support under tensor parallelism by radix select (top-p without top-k, a
per-token top-k): tp = 2 and 4 on real Gloo groups, with shards of unequal size, against one
process on the full vocabulary and against the definition (the support built token by token,
:func:`tests.logprobs.test_sampler.reference_support`); the collectives per call; the keys."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from tests._distributed import count_collectives, run_distributed
from tests._logprobs_util import forward_backward
from tests.logprobs.test_sampler import reference, reference_support

from rlops._checks import compute_dtype
from rlops.logprobs import (
    _engine,
    _support,
    linear_logprobs_and_entropy,
    logprobs_and_entropy,
)
from rlops.logprobs._plan import Plan

N, V, H = 23, 52, 6
SIZES = {2: (20, 32), 4: (9, 17, 1, 25)}  # unequal shards, one of a single id
TPS = tuple(SIZES)
INF = float("inf")
SAMPLER_KEYS = ("top_k", "top_p", "min_p")

# name -> (logits dtype, keyword arguments); "t": a per-token tensor; "ints": integer logits
# (ties within and across shards); "-inf": some logits -inf (never the target's).
CASES = {
    "top_p": (torch.float32, {"top_p": 0.8}),
    "top_p float64 over support": (
        torch.float64,
        {"top_p": 0.65, "temperature": 0.7, "entropy_over_support": True, "chunk_size": 5},
    ),
    "per-token top_p": (torch.float32, {"top_p": "t", "chunk_size": 7}),
    "per-token top_k": (torch.float32, {"top_k": "t"}),
    "per-token top_k float64": (torch.float64, {"top_k": "t", "temperature": 1.3}),
    "per-token top_k top_p": (torch.float64, {"top_k": "t", "top_p": "t", "chunk_size": 4}),
    "per-token top_k top_p min_p": (
        torch.float32,
        {"top_k": "t", "top_p": 0.9, "min_p": 0.02, "entropy_over_support": True},
    ),
    "top_p min_p": (torch.float32, {"top_p": 0.85, "min_p": "t", "temperature": 0.9}),
    "ties top_p": (torch.float32, {"top_p": 0.37, "ints": True, "temperature": 0.5}),
    "ties per-token top_k top_p": (torch.float64, {"top_k": "t", "top_p": 0.6, "ints": True}),
    "-inf logits": (torch.float32, {"top_p": 0.7, "-inf": True, "entropy_over_support": True}),
    "bfloat16 top_p": (torch.bfloat16, {"top_p": 0.7, "temperature": 0.8}),
    "bfloat16 per-token top_k top_p": (torch.bfloat16, {"top_k": "t", "top_p": "t"}),
}
LINEAR_CASES = {
    "linear top_p": (torch.float64, {"top_p": 0.75, "temperature": 0.9, "chunk_size": 7}),
    "linear per-token top_k top_p": (torch.float32, {"top_k": "t", "top_p": "t"}),
}
# Forward collectives per call: the check's all-gather, the max's all-reduce (top-p, min-p),
# one all-reduce per radix round (4 in float32, 8 in float64, twice for top-k and top-p), the
# statistics' all-gather.
COUNTED = {
    "top_p": (torch.float32, {"top_p": 0.8}, 1 + 1 + 4 + 1),
    "top_p float64": (torch.float64, {"top_p": 0.8}, 1 + 1 + 8 + 1),
    "per-token top_k": (torch.float32, {"top_k": "t"}, 1 + 4 + 1),
    "per-token top_k top_p": (torch.float32, {"top_k": "t", "top_p": 0.8}, 1 + 1 + 8 + 1),
    "top_p check off": (torch.float32, {"top_p": 0.8, "check off": True}, 1 + 4 + 1),
}


def _per_token(name: str, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if name == "top_k":
        k = torch.randint(1, V + 10, (n,), generator=gen)  # some >= V: keep all
        k[:3] = torch.tensor([1, V, V - 1])
        return k
    if name == "top_p":
        p = (torch.rand(n, generator=gen, dtype=torch.float64) * 0.9 + 0.05).to(dtype)
        p[:2] = 1.0  # keeps every token
        return p
    m = (torch.rand(n, generator=gen, dtype=torch.float64) * 0.05).to(dtype)
    m[0] = 0.0
    return m


def _case(name: str, dtype: torch.dtype, kw: dict):
    """``(logits [N, V], target, upstream grads, keyword arguments)`` of a logits case."""
    kw = dict(kw)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    logits = torch.randn(N, V, generator=gen, dtype=torch.float64) * 3
    if kw.pop("ints", False):
        logits = (logits / 1.5).round()  # a few values: ties within and across the shards
    target = torch.randint(0, V, (N,), generator=gen)
    if kw.pop("-inf", False):
        hole = torch.rand(N, V, generator=gen) < 0.3
        hole.scatter_(1, target.unsqueeze(1), False)
        logits = logits.masked_fill(hole, -INF)
    grads = [torch.randn(N, generator=gen, dtype=torch.float64) for _ in range(2)]
    cdt = compute_dtype(dtype)
    kw = {k: (_per_token(k, N, cdt, gen) if v == "t" else v) for k, v in kw.items()}
    return logits.to(dtype), target, grads, kw


def _linear_case(name: str, dtype: torch.dtype, kw: dict):
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64)
    target = torch.randint(0, V, (N,), generator=gen)
    grads = [torch.randn(N, generator=gen, dtype=torch.float64) for _ in range(2)]
    kw = {k: (_per_token(k, N, dtype, gen) if v == "t" else v) for k, v in kw.items()}
    return hidden.to(dtype), weight.to(dtype), target, grads, kw


def _cols(r: int, sizes: tuple[int, ...]) -> slice:
    return slice(sum(sizes[:r]), sum(sizes[: r + 1]))


# --------------------------------------------------------------------------- thresholds
def _edge_logits() -> tuple[torch.Tensor, dict]:
    """``[8, V]`` float32 logits with the edge cases of the threshold, and per-token params."""
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(8, V, generator=gen) * 2
    z[0] = torch.arange(V, dtype=torch.float32).remainder(5)  # ties in every shard
    z[1] = 0.0  # all tied
    z[2, :] = -INF
    z[2, 40] = 1.0  # a single finite logit, in a middle shard
    z[3, ::2] = -INF
    z[4] = -INF  # every logit -inf
    z[5, 7] = z[5, 45] = 30.0  # a tie at the top, across shards
    z[6] = torch.linspace(-1, 1, V).round(decimals=1)
    z[7, 30:] = -0.0  # signed zeros
    z[7, :30] = 0.0
    params = {
        "top_k": torch.tensor([[3], [1], [2], [V], [4], [1], [V + 5], [2]]),
        "top_p": torch.tensor([[0.5], [0.3], [1e-6], [1.0], [0.9], [1e-6], [0.77], [0.5]]),
        "min_p": torch.tensor([[0.2], [0.0], [0.5], [0.0], [0.0], [0.9], [0.1], [0.3]]),
    }
    return z, params


def _exact_logits() -> tuple[torch.Tensor, dict]:
    """``[2, V]`` float64 logits whose masses ``exp(z − max)`` are exact (1, 1/2, 1/4) and whose
    ``p·S`` equals the mass before a token exactly: that token is not kept (``<``, strictly)."""
    ln2 = math.log(2.0)
    z = torch.full((2, V), -INF, dtype=torch.float64)
    z[0, 3], z[0, 20], z[0, 45] = 0.0, -ln2, -ln2  # S = 2, p·S = 1: {3}
    z[1, 10], z[1, 30], z[1, 31], z[1, 50] = 0.0, -ln2, -2 * ln2, -2 * ln2  # p·S = 1.5: {10, 30}
    params = {
        "top_k": torch.tensor([[V], [3]]),
        "top_p": torch.tensor([[0.5], [0.75]], dtype=torch.float64),
    }
    return z, params


EXACT_CASES = [{"top_p": "t"}, {"top_k": "t", "top_p": "t"}]
THRESHOLD_CASES = [
    {"top_p": "t"},
    {"top_p": 0.45},
    {"top_k": "t"},
    {"top_k": "t", "top_p": "t"},
    {"top_k": "t", "top_p": 0.6, "min_p": "t"},
    {"top_p": "t", "min_p": "t"},
]


def _threshold_kw(kw: dict, params: dict) -> dict:
    return {k: (params[k] if v == "t" else v) for k, v in kw.items()}


class _Given(_engine.Producer):
    """A producer of logits already scaled and in the compute dtype."""

    def __init__(self, z: torch.Tensor) -> None:
        self.z = z

    def logits(self, i: int, j: int) -> tuple[torch.Tensor, bool]:
        return self.z[i:j], False


def _sharded_threshold(z: torch.Tensor, rank: int, world: int, chunk: int, kw: dict):
    """The global thresholds ``[N, 1]`` from this rank's shard of ``z`` (``kw``: the sampler's
    scalars or ``[N, 1]`` tensors)."""
    zl = z[:, _cols(rank, SIZES[world])]
    flat = (kw.get(k) for k in SAMPLER_KEYS)
    sampler = _support.Sampler(*(t.reshape(-1) if isinstance(t, torch.Tensor) else t for t in flat))
    plan = Plan(
        rows=z.shape[0], v_local=zl.shape[1], chunk=chunk, dtype=z.dtype, device=z.device,
        sampler=sampler, group=dist.group.WORLD, world=world,
    )  # fmt: skip
    return _engine.sampler_thresholds(plan, _Given(zl))


def _thresholds(rank: int, world: int) -> list[torch.Tensor]:  # in a rank of _worker
    """This rank's thresholds of :data:`THRESHOLD_CASES` on its shard of :func:`_edge_logits`,
    then of :data:`EXACT_CASES` on :func:`_exact_logits`, then those of rows with a NaN logit
    (one row each), which must not raise."""
    z, params = _edge_logits()
    out = [
        _sharded_threshold(z, rank, world, 3, _threshold_kw(kw, params)) for kw in THRESHOLD_CASES
    ]
    exact, exact_params = _exact_logits()
    out += [
        _sharded_threshold(exact, rank, world, 1, _threshold_kw(kw, exact_params))
        for kw in EXACT_CASES
    ]
    z[:, _cols(rank, SIZES[world]).start] = float("nan")
    for kw in ({"top_p": 0.5}, {"top_k": torch.full((8,), 3), "top_p": 0.5, "min_p": 0.1}):
        out.append(_sharded_threshold(z, rank, world, 8, kw))
    return out


# --------------------------------------------------------------------------- the public ops
def _worker(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    sizes = SIZES[world]
    cols = _cols(rank, sizes)
    out = {"thresholds": _thresholds(rank, world)}
    for name, (dtype, kw) in CASES.items():
        logits, target, grads, kw = _case(name, dtype, kw)
        x = logits[:, cols].clone().requires_grad_()
        lp, ent = logprobs_and_entropy(x, target, group=group, **kw)
        torch.autograd.backward([lp, ent], [g.to(lp.dtype) for g in grads])
        out[name] = {"outs": (lp.detach(), ent.detach()), "grads": [x.grad]}
    for name, (dtype, kw) in LINEAR_CASES.items():
        hidden, weight, target, grads, kw = _linear_case(name, dtype, kw)
        h = hidden.clone().requires_grad_()
        w = weight[cols].clone().requires_grad_()
        lp, ent = linear_logprobs_and_entropy(h, w, target, group=group, **kw)
        torch.autograd.backward([lp, ent], [g.to(lp.dtype) for g in grads])
        out[name] = {"outs": (lp.detach(), ent.detach()), "grads": [h.grad, w.grad]}
    out["counted"] = {}
    for name, (dtype, kw, _) in COUNTED.items():
        kw = dict(kw)
        off = kw.pop("check off", False)
        logits, target, grads, kw = _case(name, dtype, kw)
        if off:  # equal shards without the check
            os.environ["RLOPS_TP_CHECK"] = "0"
        shard = slice(rank * (V // world), (rank + 1) * (V // world)) if off else cols
        x = logits[:, shard].clone().requires_grad_()
        with count_collectives() as fwd:
            lp, ent = logprobs_and_entropy(x, target, group=group, **kw)
        with count_collectives() as bwd:
            torch.autograd.backward([lp, ent], [g.to(lp.dtype) for g in grads])
        os.environ.pop("RLOPS_TP_CHECK", None)
        out["counted"][name] = {
            "fwd": dict(fwd),
            "bwd": dict(bwd),
            "grad": x.grad,
            "outs": (lp.detach(), ent.detach()),
        }
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    """Every rank's results of :func:`_worker`, per tp (one group spawned per tp)."""
    return {tp: run_distributed(_worker, tp, timeout=240) for tp in TPS}


@pytest.mark.distributed
@pytest.mark.parametrize("tp", TPS)
def test_thresholds_match_the_definition_and_one_process(results, tp):
    """Ties (within and across shards), p = 1, a support of one token, k >= V, -inf logits,
    an all -inf row, signed zeros: the support ``z >= t`` is the definition's, and ``t`` is
    the one-process threshold."""
    got = [res["thresholds"] for res in results[tp]]
    z, params = _edge_logits()
    for c, kw in enumerate(THRESHOLD_CASES):
        p = _threshold_kw(kw, params)
        one = _support.threshold_chunk(z, *(p.get(k) for k in SAMPLER_KEYS))
        for row in range(z.shape[0]):
            rkw = {k: (v[row].item() if isinstance(v, torch.Tensor) else v) for k, v in p.items()}
            expected = reference_support(z[row : row + 1], **rkw)
            for r, res in enumerate(got):
                where = (tp, r, kw, row)
                assert torch.equal(z[row : row + 1] >= res[c][row : row + 1], expected), where
        for res in got:
            assert torch.equal(res[c], one), kw
    z, params = _exact_logits()
    expected = torch.zeros_like(z, dtype=torch.bool)
    expected[0, 3] = expected[1, 10] = expected[1, 30] = True
    for row in range(2):  # the definition, as the other rows
        rkw = {k: params[k][row].item() for k in ("top_k", "top_p")}
        assert torch.equal(reference_support(z[row : row + 1], **rkw), expected[row : row + 1])
    for c, kw in enumerate(EXACT_CASES, start=len(THRESHOLD_CASES)):
        p = _threshold_kw(kw, params)
        one = _support.threshold_chunk(z, *(p.get(k) for k in SAMPLER_KEYS))
        for res in got:
            assert torch.equal(z >= res[c], expected), kw
            assert torch.equal(res[c], one), kw
    for res in got:
        for t in res[len(THRESHOLD_CASES) + len(EXACT_CASES) :]:
            assert t.shape == (8, 1) and t.dtype == torch.float32


def _tolerance(dtype: torch.dtype, *, vs_float64: bool = False) -> dict:
    """Between two results in ``dtype`` (shards merged vs one process), or with ``vs_float64``
    between one in ``dtype`` and the float64 definition (rounding only, a support change is
    far larger)."""
    if dtype == torch.float64:
        return {"rtol": 1e-10, "atol": 1e-10}
    if dtype == torch.float32:
        return {"rtol": 1e-4, "atol": 1e-4} if vs_float64 else {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 1.6e-2, "atol": 1e-3 if vs_float64 else 1e-4}


def _definition(logits, target, grads, kw):
    """logp, entropy and the logits' gradient over the support built token by token from the
    scaled logits the sampler sees (the compute dtype), evaluated in float64."""
    tau = kw.get("temperature", 1.0)
    z = (logits.to(compute_dtype(logits.dtype)) / tau).double()
    support = reference_support(z, **{k: kw[k] for k in SAMPLER_KEYS if k in kw})
    over = kw.get("entropy_over_support", False)
    return forward_backward(
        lambda x, y: reference(x, y, support, temperature=tau, over_support=over),
        (logits.double(), target),
        grads,
    )


@pytest.mark.distributed
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", list(CASES))
def test_logits_op_matches_one_process_and_the_definition(results, tp, name):
    logits, target, grads, kw = _case(name, *CASES[name])
    one = forward_backward(lambda x, y: logprobs_and_entropy(x, y, **kw), (logits, target), grads)
    exact = _definition(logits, target, grads, kw)
    tol, loose = _tolerance(logits.dtype), _tolerance(logits.dtype, vs_float64=True)
    for k in range(3):
        torch.testing.assert_close(one[k].double(), exact[k], **loose, msg=f"{name} {k}")
    for r, res in enumerate(results[tp]):
        got, cols = res[name], _cols(r, SIZES[tp])
        for k, (a, b) in enumerate(zip(got["outs"], one[:2], strict=True)):
            torch.testing.assert_close(a, b, **tol, msg=f"tp={tp} rank={r} {name} output {k}")
            torch.testing.assert_close(a.double(), exact[k], **loose)
        torch.testing.assert_close(got["grads"][0], one[2][:, cols], **tol)
        torch.testing.assert_close(got["grads"][0].double(), exact[2][:, cols], **loose)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", list(LINEAR_CASES))
def test_linear_op_matches_one_process_and_the_definition(results, tp, name):
    """Values, the weight gradient of each shard, and the sum of the partial hidden gradients."""
    hidden, weight, target, grads, kw = _linear_case(name, *LINEAR_CASES[name])
    one = forward_backward(
        lambda h, w, y: linear_logprobs_and_entropy(h, w, y, **kw), (hidden, weight, target), grads
    )
    tau = kw.get("temperature", 1.0)
    logits64 = hidden.double() @ weight.double().T
    support = reference_support(
        ((hidden @ weight.T) / tau).double(), **{k: kw[k] for k in SAMPLER_KEYS if k in kw}
    )
    assert torch.equal(
        support, reference_support(logits64 / tau, **{k: kw[k] for k in SAMPLER_KEYS if k in kw})
    )  # the float32 rounding keeps the support
    exact = forward_backward(
        lambda h, w, y: reference(h @ w.T, y, support, temperature=tau),
        (hidden.double(), weight.double(), target),
        grads,
    )
    tol, loose = _tolerance(hidden.dtype), _tolerance(hidden.dtype, vs_float64=True)
    res = results[tp]
    for r, got in enumerate(x[name] for x in res):
        cols = _cols(r, SIZES[tp])
        for k, (a, b) in enumerate(zip(got["outs"], one[:2], strict=True)):
            torch.testing.assert_close(a, b, **tol, msg=f"tp={tp} rank={r} {name} output {k}")
            torch.testing.assert_close(a.double(), exact[k], **loose)
        torch.testing.assert_close(got["grads"][1], one[3][cols], **tol)
        torch.testing.assert_close(got["grads"][1].double(), exact[3][cols], **loose)
    summed = sum(x[name]["grads"][0] for x in res)
    torch.testing.assert_close(summed, one[2], **tol)
    torch.testing.assert_close(summed.double(), exact[2], **loose)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", list(COUNTED))
def test_collectives_per_call(results, tp, name):
    """A fixed number of forward collectives whatever tp (the radix rounds: 4 in float32, 8 in
    float64), all-reduces but the check's and the statistics' all-gathers; none backward."""
    dtype, kw, n_forward = COUNTED[name]
    kw = dict(kw)
    off = kw.pop("check off", False)
    logits, target, grads, kw = _case(name, dtype, kw)
    one = forward_backward(lambda x, y: logprobs_and_entropy(x, y, **kw), (logits, target), grads)
    for r, res in enumerate(results[tp]):
        got = res["counted"][name]
        assert sum(got["fwd"].values()) == n_forward, (tp, r, name, got["fwd"])
        gathers = sum(c for k, c in got["fwd"].items() if "gather" in k)
        assert gathers == (1 if off else 2), got["fwd"]
        assert got["fwd"].get("all_reduce", 0) == n_forward - gathers, got["fwd"]
        assert got["bwd"] == {}, got["bwd"]
        cols = slice(r * (V // tp), (r + 1) * (V // tp)) if off else _cols(r, SIZES[tp])
        for a, b in zip(got["outs"], one[:2], strict=True):
            torch.testing.assert_close(a, b, **_tolerance(dtype))
        torch.testing.assert_close(got["grad"], one[2][:, cols], **_tolerance(dtype))


# --------------------------------------------------------------------------- keys
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_key_mapping_preserves_order(dtype):
    """``x < y`` ⇒ key(x) < key(y), equal values (but ±0) share a key, -0.0 sits just below
    +0.0, and the inverse restores every bit pattern (NaNs included)."""
    info = torch.finfo(dtype)
    denormal = torch.nextafter(torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype))
    special = torch.tensor(
        [
            -INF,
            -info.max,
            -1.0,
            -info.tiny,
            -denormal.item(),
            -0.0,
            0.0,
            denormal.item(),
            3 * denormal.item(),
            info.tiny,
            1.0,
            1.0,
            info.max,
            INF,
        ],
        dtype=dtype,
    )
    gen = torch.Generator().manual_seed(21)
    scaled = torch.randn(500, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(
        -30, 30, (500,), generator=gen
    )
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int64
    bits = torch.randint(-(2**31), 2**31 - 1, (1500,), generator=gen, dtype=torch.int64)
    if dtype == torch.float64:
        bits = bits * (2**32) + torch.randint(0, 2**32, (1500,), generator=gen)
    raw = bits.to(int_dtype).view(dtype)  # every exponent, denormals among them
    raw = raw[~raw.isnan()]
    x = torch.cat([special, scaled.to(dtype), raw])
    key = _support.float_key(x)
    assert key.dtype == torch.int64
    less = x.unsqueeze(1) < x.unsqueeze(0)
    assert torch.equal(
        less,
        (key.unsqueeze(1) < key.unsqueeze(0)) & ~((x.unsqueeze(1) == 0) & (x.unsqueeze(0) == 0)),
    )
    same = x.unsqueeze(1) == x.unsqueeze(0)
    same_bits = x.view(int_dtype).unsqueeze(1) == x.view(int_dtype).unsqueeze(0)
    assert torch.equal(same & same_bits, key.unsqueeze(1) == key.unsqueeze(0))
    zeros = _support.float_key(torch.tensor([-0.0, 0.0], dtype=dtype))
    assert zeros[1] - zeros[0] == 1
    nan = torch.tensor([float("nan"), -float("nan")], dtype=dtype)
    every = torch.cat([x, nan])
    back = _support.key_float(_support.float_key(every), dtype)
    assert torch.equal(back.view(int_dtype), every.view(int_dtype))
    # Bytes from the top: the first signed (-128..127), as the select reads them.
    n_bytes = _support.rounds(dtype)
    assert n_bytes == (4 if dtype == torch.float32 else 8)
    top = key >> (8 * (n_bytes - 1))
    assert top.min() >= -128 and top.max() <= 127


def test_uses_radix_only_where_the_candidates_cannot_merge():
    k = torch.ones(3, dtype=torch.long)
    p = torch.full((3,), 0.5)
    assert _support.uses_radix(_support.Sampler(None, 0.9, None))
    assert _support.uses_radix(_support.Sampler(None, p, 0.1))
    assert _support.uses_radix(_support.Sampler(k, None, None))
    assert _support.uses_radix(_support.Sampler(k, 0.5, p))
    assert not _support.uses_radix(_support.Sampler(5, 0.9, None))
    assert not _support.uses_radix(_support.Sampler(5, p, None))
    assert not _support.uses_radix(_support.Sampler(None, None, 0.1))
    assert not _support.uses_radix(_support.Sampler(None, 1.0, 0.1))  # p = 1 keeps all
    assert math.isclose(
        float(_support.key_float(_support.float_key(torch.tensor([1.5])), torch.float32)), 1.5
    )
