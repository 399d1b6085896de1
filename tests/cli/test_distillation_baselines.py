"""The distillation baselines of ``rlops bench`` and ``benchmarks/distillation.py``.

``topk_forward_kl_chunked`` re-implements verl's ``use_chunked_topk`` path: it is checked
against verl's own functions (``verl/trainer/distillation/fsdp/losses.py``, as copied verbatim
in ``tests/distillation/test_verl.py`` at commit 072cf9bd; their code is the same at
1dda039b9c6311889a9c9a26040677e1254814f9, where ``use_chunked_topk`` calls them) for its
values and gradients (bit for bit) and for how it computes them (the same autograd graph, the
same tensors saved for the backward), and, in float64, against the top-k forward KL written
from its definition and against verl's default path (``topk_forward_kl_log_softmax``), values
and gradients through the output layer. The workload's variants run, and refuse what they do
not measure.
"""

from __future__ import annotations

import collections

import pytest
import torch
from tests.distillation.test_verl import _chunked_topk_log_probs, kl_divergence

from rlops.measure import workloads
from rlops.measure.baselines import topk_forward_kl_chunked, topk_forward_kl_log_softmax

F64 = torch.float64


def verl_chunked(logits, teacher_logp, teacher_ids, chunk_size):
    """verl's ``use_chunked_topk`` forward KL (``log_prob_min_clamp=None``) on ``[1, N, V]``."""
    log_q = _chunked_topk_log_probs(logits, teacher_ids[None], chunk_size=chunk_size)
    return kl_divergence(log_q=log_q, log_p=teacher_logp[None])


def inputs(n: int, v: int, k: int, dtype: torch.dtype, seed: int = 0):
    """Logits ``[n, v]`` (a leaf), the teacher's top-k log-probs and ids ``[n, k]``."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=gen, dtype=F64) * 3).to(dtype).requires_grad_()
    top = torch.log_softmax(torch.randn(n, v, generator=gen, dtype=F64) * 3, -1).topk(k, -1)
    return logits, top.values.to(torch.promote_types(dtype, torch.float32)), top.indices


def graph(out: torch.Tensor) -> collections.Counter:
    """The autograd nodes behind ``out``, by kind."""
    seen, kinds, todo = set(), collections.Counter(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        kinds[type(fn).__name__] += 1
        todo += [nxt for nxt, _ in fn.next_functions]
    return kinds


def saved(fn):
    """``(fn(), [(numel, dtype, storage) of every tensor autograd saves for the backward]``."""
    out = []

    def pack(t):
        out.append((t.numel(), t.dtype, t.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return fn(), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "chunk"), [(1, 4096), (127, 128), (129, 128), (1000, 128)])
def test_chunked_is_verls_path_bit_for_bit(n, chunk, dtype):
    """Values, gradients, autograd graph and saved tensors equal those of verl's functions."""
    logits, a, ids = inputs(n, 129, 7, dtype, seed=n)
    upstream = torch.randn(n, generator=torch.Generator().manual_seed(1))
    leaf = logits.detach()[None].requires_grad_()  # verl's [1, N, V], a leaf of its own
    ours, ours_saved = saved(lambda: topk_forward_kl_chunked(logits, a, ids, chunk_size=chunk))
    theirs, theirs_saved = saved(lambda: verl_chunked(leaf, a, ids, chunk))
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs[0])
    (grad,) = torch.autograd.grad(ours, logits, upstream)
    (grad_verl,) = torch.autograd.grad(theirs, leaf, upstream[None])
    assert torch.equal(grad, grad_verl[0])
    assert graph(ours.sum()) == graph(theirs.sum())
    assert [s[:2] for s in ours_saved] == [s[:2] for s in theirs_saved]


def definition(logits, teacher_logp, teacher_ids, tail=False):
    """``sum_j p_j (log p_j - log q_j)``, ``q = exp(z) / sum exp(z)`` written plainly (float64,
    logits of a few units), plus ``p_r log(p_r / q_r)`` of the rest with ``tail``; and the
    gradient with respect to the logits: ``(sum_j p_j) q - p`` on the ids, and with the tail
    ``p_r (q - q 1[ids]) / q_r`` more."""
    z = logits.detach()
    q = z.exp() / z.exp().sum(-1, keepdim=True)
    p, q_k = teacher_logp.exp(), q.gather(-1, teacher_ids)
    loss = (p * (p.log() - q_k.log())).sum(-1)
    grad = q * p.sum(-1, keepdim=True) - torch.zeros_like(q).scatter(-1, teacher_ids, p)
    if tail:
        p_r, q_r = 1 - p.sum(-1), 1 - q_k.sum(-1)
        loss = loss + p_r * (p_r.log() - q_r.log())
        in_ids = torch.zeros_like(q).scatter(-1, teacher_ids, q_k)
        grad = grad + (p_r / q_r)[:, None] * (in_ids - q * q_k.sum(-1, keepdim=True))
    return loss, grad


@pytest.mark.parametrize("chunk", [128, 4096])
@pytest.mark.parametrize("n", [1, 127, 128, 129, 1000])
def test_chunked_and_default_paths_give_the_definition_in_float64(n, chunk):
    """Loss and gradients of hidden states and output weight (``z = h @ W.T``), random upstream
    gradients: verl's chunked path, its default path and the definition agree in float64."""
    gen = torch.Generator().manual_seed(n)
    hidden = torch.randn(n, 16, generator=gen, dtype=F64).requires_grad_()
    weight = torch.randn(300, 16, generator=gen, dtype=F64).requires_grad_()
    _, a, ids = inputs(n, 300, 9, F64, seed=n + 1)
    upstream = torch.randn(n, generator=gen, dtype=F64)
    loss_def, grad_z = definition(hidden @ weight.T, a, ids)
    grad_z = grad_z * upstream[:, None]
    expected = (loss_def, grad_z @ weight.detach(), grad_z.T @ hidden.detach())
    for path in (
        lambda z: topk_forward_kl_chunked(z, a, ids, chunk_size=chunk),
        lambda z: topk_forward_kl_log_softmax(z, a, ids),
    ):
        loss = path(hidden @ weight.T)
        assert loss.dtype == F64
        got = (loss.detach(), *torch.autograd.grad(loss, (hidden, weight), upstream))
        for x, y in zip(got, expected):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n", [1, 129])
def test_default_path_with_the_tail_gives_the_definition_in_float64(n):
    logits, a, ids = inputs(n, 200, 5, F64, seed=n)
    upstream = torch.randn(n, generator=torch.Generator().manual_seed(2), dtype=F64)
    loss = topk_forward_kl_log_softmax(logits, a, ids, tail=True)
    (grad,) = torch.autograd.grad(loss, logits, upstream)
    loss_def, grad_def = definition(logits, a, ids, tail=True)
    torch.testing.assert_close(loss.detach(), loss_def, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, grad_def * upstream[:, None], rtol=1e-10, atol=1e-10)


def test_only_the_default_path_saves_a_vocabulary_wide_tensor():
    """What each path keeps for the backward beyond the logits themselves: the default path its
    ``[N, V]`` log-softmax; the chunked path ``[N, k]`` and ``[N, 1]`` tensors only."""
    n, v, k = 300, 1000, 8
    logits, a, ids = inputs(n, v, k, torch.float32)
    own = logits.untyped_storage().data_ptr()

    def extra(fn) -> int:
        _, kept = saved(fn)
        return sum(numel for numel, _, ptr in kept if ptr != own)

    assert extra(lambda: topk_forward_kl_log_softmax(logits, a, ids)) >= n * v
    assert extra(lambda: topk_forward_kl_chunked(logits, a, ids, chunk_size=128)) <= n * (2 * k + 2)


def test_chunked_path_on_no_rows():
    """No rows: an empty loss, not attached to the logits, as verl's."""
    logits, a, ids = inputs(0, 50, 4, torch.float32)
    loss = topk_forward_kl_chunked(logits, a, ids)
    theirs = verl_chunked(logits.detach()[None].requires_grad_(), a, ids, 4096)
    assert loss.shape == (0,) and theirs.shape == (1, 0)
    assert not loss.requires_grad and not theirs.requires_grad


@pytest.mark.parametrize("variant", workloads.DISTILLATION_STEPS)
@pytest.mark.parametrize("tail", [False, True])
def test_every_distillation_step_runs(variant, tail):
    if tail and variant == "verl chunked":
        with pytest.raises(ValueError, match="no tail"):
            workloads.setup_distillation(16, 64, 8, 4, variant, tail=tail)
        return
    step = workloads.setup_distillation(16, 64, 8, 4, variant, tail=tail)
    step()
    step()


def test_an_unknown_distillation_step_is_refused():
    with pytest.raises(ValueError, match="variant must be one of"):
        workloads.setup_distillation(16, 64, 8, 4, "chunked")
