"""rlops.compat.sglang against SGLang's sampler, restated from its code in float64.

The restatement follows ``python/sglang/srt/layers/sampler.py`` (``Sampler.forward``: the
greedy batch's ``log_softmax``; ``SGLANG_RETURN_ORIGINAL_LOGPROB``'s ``log_softmax`` before
the temperature; the ``--rl-on-policy-target`` path's ``log_softmax(bf16(bf16(x) / T))``; the
standard path's ``log(softmax(x / T))``, taken before ``_sample_from_probs`` filters) and
``python/sglang/srt/sampling/sampling_params.py`` (temperature below 1e-6: greedy, sampled as
T = 1 with top_k = 1; top_k = -1: the whole vocabulary). Targets are drawn as its torch backend
draws them (``top_k_top_p_min_p_sampling_from_probs_torch``), so they lie in its support.
rlops' float32 log-probs must be within twice the error of the restatement run in float32 (the
engine's precision) of the float64 one (tests/tolerances.py).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from tests.tolerances import assert_within_reference, ulp_at

import rlops
from rlops.compat import sglang

SEED = 20261207
SHAPES = [(1, 7), (33, 129), (128, 1000)]
DTYPES = [torch.float32, torch.bfloat16]
TEMPERATURES = (0.7, 1.0, 1.3)
FILTERS = list(itertools.product((-1, 1, 5), (1.0, 0.9), (0.0, 0.05)))  # SGLang's top_k, p, min_p


# --------------------------------------------------------------------------- the engine
def sglang_logprobs(x, temperature, *, original=False, rl=None, dtype=torch.float64):
    """``[N, V]``: the log-probs ``Sampler.forward`` gathers the sampled token from."""
    if temperature < 1e-6:  # SamplingParams: greedy is temperature 1 with top_k 1
        temperature = 1.0
    if original:
        return torch.log_softmax(x.to(dtype), -1)
    if rl is not None:
        z = (x.bfloat16() / torch.tensor(temperature, dtype=torch.float32)).bfloat16()
        return torch.log_softmax(z.to(dtype), -1)
    return torch.log(torch.softmax(x.to(dtype) / temperature, -1))


def sampled(x, temperature, top_k, top_p, min_p, gen) -> torch.Tensor:
    """Targets drawn as ``top_k_top_p_min_p_sampling_from_probs_torch`` draws them."""
    if temperature < 1e-6:
        temperature, top_k = 1.0, 1
    probs = torch.softmax(x.double() / temperature, -1)
    n, v = x.shape
    top_ks = torch.full((n,), v if top_k == -1 else top_k)  # -1: TOP_K_ALL
    top_ps, min_ps = torch.full((n,), top_p).double(), torch.full((n,), min_p).double()
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    probs_sort[torch.arange(0, v).view(1, -1) >= top_ks.view(-1, 1)] = 0.0
    probs_sort[(probs_sum - probs_sort) > top_ps.view(-1, 1)] = 0.0
    if min_p > 0:
        probs_sort[probs_sort < (probs_sort[:, 0] * min_ps).view(-1, 1)] = 0.0
    pick = torch.multinomial(probs_sort, 1, generator=gen)
    return probs_idx.gather(1, pick).squeeze(-1)


def make_logits(n: int, v: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, v, generator=gen) * 2).to(dtype)


def check(name, logits, target, logp, **mode):
    pick = target[:, None]
    oracle = sglang_logprobs(logits, **mode).gather(-1, pick)[:, 0]
    ref = sglang_logprobs(logits, **mode, dtype=torch.float32).gather(-1, pick)[:, 0]
    assert bool(logp.isfinite().all()), name
    assert_within_reference(name, logp, oracle, ref)


# --------------------------------------------------------------------------- the modes
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_default_matches_sglang(shape, dtype, temperature):
    """The temperature applied, the filters not: for every filter setting."""
    gen = torch.Generator().manual_seed(SEED + shape[1])
    logits = make_logits(*shape, dtype, gen)
    for top_k, top_p, min_p in FILTERS:
        target = sampled(logits, temperature, top_k, top_p, min_p, gen)
        opts = sglang.logprob_options(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
        )
        logp, _ = rlops.logprobs_and_entropy(logits, target, **opts)
        name = f"default {shape} {dtype} t={temperature} k={top_k} p={top_p} m={min_p}"
        check(name, logits, target, logp, temperature=temperature)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_return_original_logprob_matches_sglang(shape, dtype):
    gen = torch.Generator().manual_seed(SEED + 1)
    logits = make_logits(*shape, dtype, gen)
    target = sampled(logits, 0.7, 5, 0.9, 0.05, gen)
    opts = sglang.logprob_options(
        temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, return_original_logprob=True
    )
    assert opts["temperature"] == 1.0
    logp, _ = rlops.logprobs_and_entropy(logits, target, **opts)
    check(f"original {shape} {dtype}", logits, target, logp, temperature=0.7, original=True)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_rl_on_policy_target_matches_sglang(shape, temperature):
    """From the bfloat16 logits; the engine's bfloat16 value within one bfloat16 ulp."""
    gen = torch.Generator().manual_seed(SEED + 2)
    logits = make_logits(*shape, torch.float32, gen)
    target = sampled(logits, temperature, -1, 0.9, 0.0, gen)
    opts = sglang.logprob_options(temperature=temperature, top_p=0.9, rl_on_policy_target="fsdp")
    logp, _ = rlops.logprobs_and_entropy(logits.bfloat16(), target, **opts)
    mode = {"temperature": temperature, "rl": "fsdp"}
    check(f"rl_on_policy_target {shape} t={temperature}", logits, target, logp, **mode)
    engine = sglang_logprobs(logits, **mode, dtype=torch.bfloat16).gather(-1, target[:, None])
    gap = (logp.bfloat16().double() - engine[:, 0].double()).abs()
    assert bool((gap <= ulp_at(torch.bfloat16, 1.0) * engine[:, 0].double().abs().clamp(1)).all())


def test_rl_on_policy_target_with_a_temperature_is_not_expressible():
    with pytest.raises(NotImplementedError, match=r"rl_on_policy_target='fsdp'.*bfloat16"):
        sglang.logprob_options(temperature=0.7, rl_on_policy_target="fsdp")
    # the original log-prob comes before the temperature: nothing to round
    opts = sglang.logprob_options(
        temperature=0.7, rl_on_policy_target="fsdp", return_original_logprob=True
    )
    assert opts["temperature"] == 1.0


def test_linear_op_matches_sglang():
    gen = torch.Generator().manual_seed(SEED + 3)
    hidden, weight = torch.randn(65, 48, generator=gen), torch.randn(257, 48, generator=gen) / 4
    logits64 = hidden.double() @ weight.double().T
    target = sampled(logits64, 0.7, 5, 0.9, 0.05, gen)
    opts = sglang.logprob_options(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05)
    logp, _ = rlops.linear_logprobs_and_entropy(hidden, weight, target, **opts)
    pick = target[:, None]
    oracle = sglang_logprobs(logits64, 0.7).gather(-1, pick)[:, 0]
    ref = sglang_logprobs(hidden @ weight.T, 0.7, dtype=torch.float32).gather(-1, pick)[:, 0]
    assert_within_reference("linear", logp, oracle, ref)


# --------------------------------------------------------------------------- conventions
def test_defaults_and_greedy_are_sglangs():
    off = {"temperature": 1.0, "top_k": None, "top_p": None, "min_p": None}
    assert sglang.logprob_options() == off
    assert sglang.logprob_options(temperature=0.0, top_p=0.5) == off  # greedy: T counts as 1
    assert sglang.logprob_options(temperature=5e-7) == off
    assert sglang.logprob_options(temperature=0.7, top_k=1)["temperature"] == 0.7
    assert sglang.RL_ON_POLICY_TARGETS == ("fsdp",)


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"temperature": -0.5}, ValueError, "temperature must be a finite number >= 0"),
        ({"temperature": math.nan}, ValueError, "temperature"),
        ({"temperature": math.inf}, ValueError, "temperature"),
        ({"temperature": None}, TypeError, "temperature"),
        ({"top_k": 0}, ValueError, r"top_k must be -1 \(off\) or >= 1"),
        ({"top_k": -2}, ValueError, "top_k"),
        ({"top_k": 2.0}, TypeError, "top_k"),
        ({"top_p": 0.0}, ValueError, r"top_p must lie in \(0, 1\]"),
        ({"top_p": 1.01}, ValueError, "top_p"),
        ({"min_p": -0.01}, ValueError, r"min_p must lie in \[0, 1\]"),
        ({"min_p": math.nan}, ValueError, "min_p"),
        ({"return_original_logprob": 1}, TypeError, "return_original_logprob"),
        ({"rl_on_policy_target": "megatron"}, ValueError, "rl_on_policy_target must be one of"),
        ({"rl_on_policy_target": ""}, ValueError, "rl_on_policy_target"),
    ],
)
def test_bad_arguments(kwargs, error, names):
    with pytest.raises(error, match=names):
        sglang.logprob_options(**kwargs)
