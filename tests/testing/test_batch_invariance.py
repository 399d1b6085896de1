"""Batch invariance of rlops' log-prob ops on the chunk engine.

The op on logits is invariant bit for bit: a row's log-prob, entropy and gradient are the same
bits whatever the other rows, N, ``chunk_size`` and padding (the guarantee
``docs/testing.md`` states). The fused linear op is too for the log-prob and the entropy: its
logits are a GEMM per block of rows, and a BLAS sums the rows left outside its row tiles with
another kernel (MKL: a call of 1–3 rows, a thread's last ``M mod 4``), so every call has a
multiple of 16 rows (zero rows pad the last block); checked here at 1 and 2 threads, and
under ``ATEN_CPU_CAPABILITY=default`` by the suite's other CPU dispatch. The hidden states'
gradient sums over vocabulary tiles whose width follows N: held to the rule against the
float64 definition in every batch instead."""

from __future__ import annotations

import pytest
import torch
from tests.tolerances import error_bound

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


@pytest.mark.parametrize("threads", [1, 2])
def test_the_linear_op_is_the_same_bits_whatever_the_batch(threads):
    """Log-prob and entropy bit for bit (every batch and chunk size, at this thread count);
    the hidden states' gradient within the rule of the float64 definition."""
    (hidden, _, target), batches = _batches()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        base = _op("linear", hidden, None, target, None)
        got = {
            (name, chunk_size): _op("linear", h, z, t, chunk_size)
            for chunk_size in CHUNK_SIZES
            for name, h, z, t, _, _ in batches
        }
    finally:
        torch.set_num_threads(before)
    grads = []
    for dt in (torch.float64, torch.float32):
        h = hidden.to(dt).requires_grad_(True)
        lp, ent = linear_logprobs_and_entropy_reference(h, WEIGHT.to(dt), target, temperature=0.7)
        (lp.sum() + ent.sum()).backward()
        grads.append(h.grad)
    ref_err = float((grads[1].double() - grads[0]).abs().max())
    bound = error_bound(ref_err, torch.float32, float(grads[0].abs().max()))
    differ = []
    for chunk_size in CHUNK_SIZES:
        for name, _, _, _, pos, idx in batches:
            out = got[(name, chunk_size)]
            for k, what in enumerate(("logp", "entropy")):
                mine, theirs = out[k][pos], base[k][idx]
                if not torch.equal(mine, theirs):
                    differ.append(
                        f"{name}, chunk_size={chunk_size}, {what}: max difference "
                        f"{float((mine - theirs).abs().max()):.2e}"
                    )
            err = (out[2][pos].double() - grads[0][idx]).abs().max()
            if not err <= bound:
                differ.append(f"{name}, chunk_size={chunk_size}, gradient: {float(err):.2e}")
    assert not differ, differ


@pytest.mark.parametrize("chunk_size", [3])
def test_the_contract_holds_bitwise_at_every_chunk_size(chunk_size):
    def fn(logits, target, temperature):
        return rlops.logprobs_and_entropy(
            logits, target, temperature=temperature, chunk_size=chunk_size, method="chunked"
        )

    report = check_logprobs(fn, vocab_sizes=(1000,), rows=8, bitwise=True)
    assert report, str(report)


def test_the_linear_contract_holds_bitwise():
    """``check_logprobs(..., bitwise=True)`` on the linear op, its hidden states the logits and
    its weight the identity (``x @ I`` is ``x`` exactly: one nonzero product per sum)."""

    def fn(logits, target, temperature):
        eye = torch.eye(logits.shape[-1], dtype=logits.dtype)
        return rlops.linear_logprobs_and_entropy(
            logits, eye, target, temperature=temperature, chunk_size=3
        )

    report = check_logprobs(fn, vocab_sizes=(1000,), rows=8, bitwise=True)
    assert report["batch_invariance"].ok, str(report)
