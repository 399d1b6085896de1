"""Batch invariance of rlops' log-prob ops on the chunk engine.

The op on logits is invariant bit for bit: a row's log-prob, entropy and gradient are the same
bits whatever the other rows, N, ``chunk_size`` and padding (the guarantee
``docs/testing.md`` states). The fused linear op is not, on a CPU with MKL: the logits are a
GEMM per chunk of rows, and MKL picks its kernel (so the order of the sum over ``H``, and over
``V`` for the hidden states' gradient) by the chunk's row count; a row's bits then follow the
chunk it lands in (about one float32 ulp of the logits). There the test holds the linear op to
the rule against the float64 definition in every batch instead."""

from __future__ import annotations

import pytest
import torch

import rlops
from rlops.logprobs.reference import linear_logprobs_and_entropy_reference
from rlops.testing import check_logprobs

V, H = 1000, 64


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, H, generator=g),
        torch.randn(n, V, generator=g) * 3,
        torch.randint(0, V, (n,), generator=g),
    )


WEIGHT = torch.randn(V, H, generator=torch.Generator().manual_seed(99)) / H**0.5


def _op(kind: str, hidden, logits, target, chunk_size, grad=True):
    if kind == "logits":
        x = logits.clone().requires_grad_(True)
        logp, ent = rlops.logprobs_and_entropy(
            x, target, temperature=0.7, chunk_size=chunk_size, method="chunked"
        )
    else:
        x = hidden.clone().requires_grad_(True)
        logp, ent = rlops.linear_logprobs_and_entropy(
            x, WEIGHT, target, temperature=0.7, chunk_size=chunk_size
        )
    if grad:
        (logp.sum() + ent.sum()).backward()
    return logp.detach(), ent.detach(), x.grad


def _batches():
    hidden, logits, target = _rows(16, 0)
    ph, pl, pt = _rows(21, 1)
    pl[:8] = 0.0
    pl[8:16] += 100.0
    every = torch.arange(16)
    batches = [  # (name, hidden, logits, target, positions of base rows idx, idx)
        *[
            (f"row {i} alone", hidden[i : i + 1], logits[i : i + 1], target[i : i + 1], [0], [i])
            for i in (0, 9, 15)
        ],
        ("first 5", hidden[:5], logits[:5], target[:5], every[:5], every[:5]),
        ("reversed", hidden.flip(0), logits.flip(0), target.flip(0), every, every.flip(0)),
        (
            "padded N=37",
            torch.cat([ph[:20], hidden, ph[20:]]),
            torch.cat([pl[:20], logits, pl[20:]]),
            torch.cat([pt[:20], target, pt[20:]]),
            every + 20,
            every,
        ),
    ]
    return (hidden, logits, target), batches


CHUNK_SIZES = (None, 1, 5, 256)


def test_a_row_is_the_same_bits_whatever_the_batch():
    (hidden, logits, target), batches = _batches()
    kind = "logits"
    base = _op(kind, hidden, logits, target, None)
    differ = []
    for chunk_size in CHUNK_SIZES:
        for name, h, z, t, pos, idx in batches:
            got = _op(kind, h, z, t, chunk_size)
            for k, what in enumerate(("logp", "entropy", "gradient")):
                mine, theirs = got[k][pos], base[k][idx]
                if not torch.equal(mine, theirs):
                    differ.append(
                        f"{name}, chunk_size={chunk_size}, {what}: max difference "
                        f"{float((mine - theirs).abs().max()):.2e}"
                    )
    assert not differ, differ


def test_the_linear_op_is_within_the_rule_in_every_batch():
    (hidden, _, target), batches = _batches()
    ref64, ref32 = (
        linear_logprobs_and_entropy_reference(hidden.to(dt), WEIGHT.to(dt), target, temperature=0.7)
        for dt in (torch.float64, torch.float32)
    )
    bounds = [
        2 * (r32.double() - r64).abs().max() + 4 * torch.finfo(torch.float32).eps * r64.abs()
        for r32, r64 in zip(ref32, ref64, strict=True)
    ]
    worse = []
    for chunk_size in CHUNK_SIZES:
        for name, h, z, t, pos, idx in batches:
            got = _op("linear", h, z, t, chunk_size, grad=False)
            for k, what in enumerate(("logp", "entropy")):
                err = (got[k][pos].double() - ref64[k][idx]).abs()
                if not bool((err <= bounds[k][idx]).all()):
                    worse.append(f"{name}, chunk_size={chunk_size}, {what}: {float(err.max()):.2e}")
    assert not worse, worse


@pytest.mark.parametrize("chunk_size", [3])
def test_the_contract_holds_bitwise_at_every_chunk_size(chunk_size):
    def fn(logits, target, temperature):
        return rlops.logprobs_and_entropy(
            logits, target, temperature=temperature, chunk_size=chunk_size, method="chunked"
        )

    report = check_logprobs(fn, vocab_sizes=(1000,), rows=8, bitwise=True)
    assert report, str(report)
