"""``check_logprobs``: correct implementations pass every check; each check fails on a broken
implementation of the bug it names; rlops' own ops are batch-invariant bit for bit."""

from __future__ import annotations

import pytest
import torch

import rlops
from rlops.compat import slime, verl
from rlops.testing import LOGPROB_CHECKS, check_logprobs

SMALL = {"vocab_sizes": (1000,), "rows": 8}  # the broken implementations: quick inputs


def _gather(lp: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return lp.gather(-1, target.long()[:, None])[:, 0]


def torch_path(logits, target, temperature):
    """torch's own log_softmax in float32, entropy with p·log p read as 0 where p = 0."""
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    p = lp.exp()
    return _gather(lp, target), -(p * lp.masked_fill(p == 0, 0.0)).sum(-1)


def float64_path(logits, target, temperature):
    """Everything in float64 (a result more accurate than the float32 plain one)."""
    lp = torch.log_softmax(logits.double() / temperature, dim=-1)
    p = lp.exp()
    return _gather(lp, target), -(p * lp.masked_fill(p == 0, 0.0)).sum(-1)


def rlops_chunked(logits, target, temperature):
    return rlops.logprobs_and_entropy(logits, target, temperature=temperature, method="chunked")


def verl_fns(logits, target, temperature):
    z = logits.float() / temperature  # bfloat16 logits / τ in bfloat16 would round every logit
    return verl.logprobs_from_logits(z, target), verl.entropy_from_logits(z)


def slime_fn(logits, target, temperature):
    logp, ent = slime.calculate_log_probs_and_entropy(
        logits.float() / temperature, target, None, with_entropy=True
    )
    return logp[:, 0], ent


# --------------------------------------------------------------------------- broken ones
def computed_in_bfloat16(logits, target, temperature):
    """values: the whole log-softmax in bfloat16, returned as float32."""
    lp = torch.log_softmax((logits / temperature).bfloat16(), dim=-1).float()
    return _gather(lp, target)


def dropped_tail_tile(logits, target, temperature, tile=256):
    """vocab_tail: an online log-sum-exp over whole tiles only (the partial last tile lost)."""
    z = logits.float() / temperature
    full = z.shape[-1] // tile * tile
    lse = torch.logsumexp(z[:, :full], dim=-1) if full else torch.full_like(z[:, 0], -1e30)
    return _gather(z, target) - lse


def detached(logits, target, temperature):
    """gradients: the result leaves the graph (a kernel that returns no grad_fn)."""
    return torch_path(logits.detach(), target, temperature)


def temperature_twice(logits, target, temperature):
    """temperature: the caller divided already, and so does the function."""
    return torch_path(logits / temperature, target, temperature)


def batch_max_low_precision(logits, target, temperature):
    """batch_invariance: one max over the whole batch, exponentials in float16."""
    z = (logits / temperature).half()
    m = z.max()
    lse = m.float() + torch.log(torch.exp(z - m).float().sum(-1))
    return _gather(z.float(), target) - lse


def unguarded_entropy(logits, target, temperature):
    """masked_vocab: p·log p evaluated as 0·(−inf) at masked entries."""
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return _gather(lp, target), -(lp.exp() * lp).sum(-1)


def no_max_subtracted(logits, target, temperature):
    """large_logits: log Σ exp(z) without subtracting the max."""
    z = logits.float() / temperature
    return _gather(z, target) - torch.log(torch.exp(z).sum(-1))


def bfloat16_accumulation(logits, target, temperature, tile=64):
    """low_precision: the tiles' sums accumulated in the input dtype (bfloat16)."""
    z = logits / temperature
    m = z.max(-1).values
    s = torch.zeros_like(m)
    for part in torch.exp(z - m[:, None]).split(tile, dim=-1):
        s = s + part.sum(-1)
    return (_gather(z, target) - m - torch.log(s)).float()


BROKEN = {
    "values": computed_in_bfloat16,
    "vocab_tail": dropped_tail_tile,
    "gradients": detached,
    "temperature": temperature_twice,
    "batch_invariance": batch_max_low_precision,
    "masked_vocab": unguarded_entropy,
    "large_logits": no_max_subtracted,
    "low_precision": bfloat16_accumulation,
}


def test_every_check_has_a_broken_implementation():
    assert list(BROKEN) == list(LOGPROB_CHECKS)
    assert [c.name for c in check_logprobs(torch_path, **SMALL)] == list(LOGPROB_CHECKS)


@pytest.mark.parametrize("name", list(BROKEN))
def test_each_check_catches_its_bug(name):
    report = check_logprobs(BROKEN[name], **SMALL)
    print(report)
    assert name in report.failed, str(report)
    assert not report


@pytest.mark.parametrize(
    "fn", [torch_path, float64_path, rlops_chunked, verl_fns, slime_fn], ids=lambda f: f.__name__
)
def test_correct_implementations_pass(fn):
    report = check_logprobs(fn, **SMALL, temperature=0.8)
    print(report)
    assert report, str(report)


def test_rlops_op_passes_at_the_defaults_bitwise():
    report = check_logprobs(rlops_chunked, bitwise=True)
    print(report)
    report.raise_if_failed()
    assert report["batch_invariance"].value == 0.0


def test_an_op_with_a_keyword_only_temperature_is_checked_as_it_is():
    """``rlops.logprobs_and_entropy`` takes the temperature by keyword: the check passes it so
    (``rlops check logprobs rlops:logprobs_and_entropy`` needs no wrapper)."""
    report = check_logprobs(rlops.logprobs_and_entropy, **SMALL)
    assert report, str(report)
    assert report["temperature"].ok, str(report)
