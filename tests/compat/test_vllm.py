"""rlops.compat.vllm against vLLM's V1 sampler, restated from its code in float64.

The restatement follows ``vllm/v1/sample/sampler.py`` (``Sampler.forward`` / ``sample``: the
float32 cast, the raw log-probs taken before any processor, ``apply_temperature``), the min-p
processor of ``vllm/v1/sample/logits_processor/builtin.py`` and ``apply_top_k_top_p`` /
``apply_top_k_only`` of ``vllm/v1/sample/ops/topk_topp_sampler.py`` (ascending sort, top-k
mask ``< k-th value``, top-p mask ``cumsum <= 1 - p`` with the last kept), then
``log_softmax``. Its float32 run is the engine's own precision: rlops' float32 log-probs must be
within twice its error of the float64 one (tests/tolerances.py). Targets are drawn from the
engine's sampling distribution, so they lie in its support.

Rows whose support is ill-conditioned (a cumulative mass or a min-p ratio within 1e-5 of its
threshold, where float32 and float64 may keep different tokens) are left out and counted. The
bfloat16 logits hold distinct values per row: where tied logits straddle the top-p boundary
vLLM keeps a sort-order-dependent subset (rlops keeps them all, docs/design/logprobs.md).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from tests.tolerances import assert_within_reference

import rlops
from rlops.compat import vllm

SEED = 20261206
SHAPES = [(1, 7), (33, 129), (128, 1000)]
DTYPES = [torch.float32, torch.bfloat16]
# temperature, top_k (0: off), top_p (1: off), min_p (0: off): vLLM's conventions
SETTINGS = list(itertools.product((0.7, 1.0, 1.3), (0, 1, 5), (1.0, 0.9), (0.0, 0.05)))
MARGIN = 1e-5


# --------------------------------------------------------------------------- the engine
def vllm_logits(x, mode, temperature, top_k, top_p, min_p, dtype=torch.float64):
    """``[N, V]``: what vLLM's sampler holds when it gathers the sampled token's value (the
    log-probs, or for the ``*_logits`` modes the logits), computed in ``dtype``."""
    x = x.to(dtype)
    if mode.startswith("raw_") or temperature == 0:  # greedy: SamplingParams resets filters
        return torch.log_softmax(x, -1) if mode.endswith("logprobs") else x
    x = x / max(temperature, 1e-2)  # SamplingParams raises (0, 0.01) to 0.01
    if min_p > 0:  # MinPLogitsProcessor.apply
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p, -math.inf)
    k = top_k if top_k > 0 else None
    if top_p >= 1.0 and k is not None:  # apply_top_k_only
        kth = x.topk(min(k, x.shape[-1]), dim=1).values[:, -1:]
        x = x.masked_fill(x < kth, -math.inf)
    elif top_p < 1.0:  # apply_top_k_top_p
        xs, idx = x.sort(dim=-1, descending=False, stable=True)
        if k is not None:
            kth = xs.gather(1, torch.full((xs.shape[0], 1), xs.shape[1] - min(k, xs.shape[1])))
            xs = xs.masked_fill(xs < kth, -math.inf)
        mask = xs.softmax(-1).cumsum(-1) <= 1 - top_p
        mask[:, -1] = False
        xs = xs.masked_fill(mask, -math.inf)
        x = xs.scatter(-1, idx, xs)
    return torch.log_softmax(x, -1) if mode.endswith("logprobs") else x


def ill_conditioned(x, setting) -> torch.Tensor:
    """``[N]`` bool: rows whose support moves when top_p or min_p moves by ``MARGIN`` (the
    support grows with top_p and shrinks with min_p: the two extremes bracket it)."""
    t, k, p, m = setting
    wide_p, narrow_p = (1.0, 1.0) if p >= 1.0 else (min(p + MARGIN, 1.0), p - MARGIN)
    wide = vllm_logits(x, "processed_logits", t, k, wide_p, m * (1 - MARGIN)).isfinite()
    narrow = vllm_logits(x, "processed_logits", t, k, narrow_p, m * (1 + MARGIN)).isfinite()
    return (wide != narrow).any(-1)


def make_logits(n: int, v: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.float32:
        return torch.randn(n, v, generator=gen) * 2
    pool = (torch.randn(40 * v, generator=gen) * 2).bfloat16().unique()  # distinct values
    assert pool.numel() >= v
    pick = torch.rand(n, pool.numel(), generator=gen).argsort(-1)[:, :v]
    return pool[pick]


def sampled(x, setting, gen) -> torch.Tensor:
    """Targets drawn from the engine's sampling distribution (inside its support)."""
    probs = vllm_logits(x, "processed_logprobs", *setting).exp()
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def check(name, logits, target, mode, setting, logp, keep):
    oracle = vllm_logits(logits, mode, *setting)
    ref = vllm_logits(logits, mode, *setting, dtype=torch.float32)
    if mode.endswith("_logits"):  # the log-prob that follows from the engine's logits
        oracle = oracle - oracle.logsumexp(-1, keepdim=True)
        ref = ref - ref.logsumexp(-1, keepdim=True)
    oracle, ref = oracle.gather(-1, target[:, None])[:, 0], ref.gather(-1, target[:, None])[:, 0]
    assert bool(logp.isfinite().all()), name
    assert_within_reference(name, logp[keep], oracle[keep], ref[keep])


# --------------------------------------------------------------------------- the modes
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "t{}-k{}-p{}-m{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_processed_modes_match_vllm(shape, dtype, setting):
    gen = torch.Generator().manual_seed(SEED + shape[1])
    logits = make_logits(*shape, dtype, gen)
    target = sampled(logits, setting, gen)
    keep = ~ill_conditioned(logits, setting)
    assert int(keep.sum()) >= shape[0] * 0.9 - 1, f"{int((~keep).sum())} rows left out"
    t, k, p, m = setting
    for mode in ("processed_logprobs", "processed_logits"):
        opts = vllm.logprob_options(mode, temperature=t, top_k=k, top_p=p, min_p=m)
        logp, _ = rlops.logprobs_and_entropy(logits, target, **opts)
        check(f"{mode} {shape} {dtype} {setting}", logits, target, mode, setting, logp, keep)


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_raw_modes_match_vllm(shape, dtype, mode):
    """The raw value ignores the sampler: the tokens are still sampled under its filters."""
    gen = torch.Generator().manual_seed(SEED + 1)
    logits = make_logits(*shape, dtype, gen)
    setting = (0.7, 5, 0.9, 0.05)
    target = sampled(logits, setting, gen)
    opts = vllm.logprob_options(mode, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05)
    assert opts == {"temperature": 1.0, "top_k": None, "top_p": None, "min_p": None}
    logp, _ = rlops.logprobs_and_entropy(logits, target, **opts)
    keep = torch.ones(shape[0], dtype=torch.bool)  # the raw value has no support to condition
    check(f"{mode} {shape} {dtype}", logits, target, mode, setting, logp, keep)


def test_linear_op_matches_vllm():
    """Through the fused output layer: the engine's logits are ``hidden @ weight.T``."""
    gen = torch.Generator().manual_seed(SEED + 2)
    hidden, weight = torch.randn(65, 48, generator=gen), torch.randn(257, 48, generator=gen) / 4
    setting = (0.7, 0, 0.9, 0.05)
    logits64 = hidden.double() @ weight.double().T
    target = sampled(logits64, setting, gen)
    opts = vllm.logprob_options("processed_logprobs", temperature=0.7, top_p=0.9, min_p=0.05)
    logp, _ = rlops.linear_logprobs_and_entropy(hidden, weight, target, **opts)
    mode = "processed_logprobs"
    oracle = vllm_logits(logits64, mode, *setting).gather(-1, target[:, None])[:, 0]
    ref = vllm_logits(hidden @ weight.T, mode, *setting, dtype=torch.float32)
    keep = ~ill_conditioned(logits64, setting)
    assert int(keep.sum()) >= 60
    assert_within_reference(
        "linear", logp[keep], oracle[keep], ref.gather(-1, target[:, None])[keep, 0]
    )


# --------------------------------------------------------------------------- conventions
def test_defaults_are_vllms():
    off = {"temperature": 1.0, "top_k": None, "top_p": None, "min_p": None}
    assert vllm.logprob_options() == off  # raw_logprobs is vLLM's default mode
    assert vllm.logprob_options("processed_logprobs") == off
    assert vllm.logprob_options("processed_logprobs", top_k=-1) == off  # -1 and 0: off
    assert vllm.LOGPROBS_MODES == ("raw_logprobs", "raw_logits", "processed_logprobs",
                                   "processed_logits")  # fmt: skip


def test_greedy_and_small_temperatures():
    """temperature 0 is greedy (log_softmax of the logits, filters reset); (0, 0.01) -> 0.01."""
    greedy = vllm.logprob_options("processed_logprobs", temperature=0, top_k=3, top_p=0.5)
    assert greedy == {"temperature": 1.0, "top_k": None, "top_p": None, "min_p": None}
    small = vllm.logprob_options("processed_logprobs", temperature=0.001, min_p=0.1)
    assert small == {"temperature": 0.01, "top_k": None, "top_p": None, "min_p": 0.1}
    gen = torch.Generator().manual_seed(SEED + 3)
    logits = torch.randn(9, 31, generator=gen)
    target = torch.randint(0, 31, (9,), generator=gen)
    logp, _ = rlops.logprobs_and_entropy(logits, target, **greedy)
    oracle = vllm_logits(logits, "processed_logprobs", 0.0, 3, 0.5, 0.0)
    ref = vllm_logits(logits, "processed_logprobs", 0.0, 3, 0.5, 0.0, dtype=torch.float32)
    pick = target[:, None]
    assert_within_reference(
        "greedy", logp, oracle.gather(-1, pick)[:, 0], ref.gather(-1, pick)[:, 0]
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"logprobs_mode": "processed"}, ValueError, "logprobs_mode must be one of"),
        ({"logprobs_mode": None}, ValueError, "logprobs_mode"),
        ({"temperature": -0.5}, ValueError, "temperature must be a finite number >= 0"),
        ({"temperature": math.nan}, ValueError, "temperature"),
        ({"temperature": math.inf}, ValueError, "temperature"),
        ({"temperature": "1"}, TypeError, "temperature"),
        ({"top_k": -2}, ValueError, r"top_k must be 0 or -1 \(off\) or >= 1"),
        ({"top_k": 1.5}, TypeError, "top_k"),
        ({"top_k": True}, TypeError, "top_k"),
        ({"top_k": torch.tensor(3)}, TypeError, "top_k"),
        ({"top_p": 0.0}, ValueError, r"top_p must lie in \(0, 1\]"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_p": math.nan}, ValueError, "top_p"),
        ({"min_p": -0.1}, ValueError, r"min_p must lie in \[0, 1\]"),
        ({"min_p": 1.1}, ValueError, "min_p"),
        ({"min_p": None}, TypeError, "min_p"),
    ],
)
def test_bad_arguments(kwargs, error, names):
    with pytest.raises(error, match=names):
        vllm.logprob_options(**kwargs)
