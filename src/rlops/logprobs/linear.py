"""Fused output layer + log-probs + entropy: ``hidden @ weightᵀ`` chunk by chunk, never ``[N, V]``.

Each token chunk's logits ``[chunk, V_local]`` are formed, reduced to per-token statistics and
dropped; the backward recomputes them and accumulates the gradients of ``hidden`` and
``weight``, per ``[tokens, vocabulary]`` tile of the chunk's size (so the weight and its
gradient move once per token block), or in the forward's chunks under a sampler threshold.
Vocabulary-parallel as :func:`rlops.logprobs.logprobs_and_entropy`: one collective in the
forward (after the same consistency check), none in the backward.

The gradient of ``hidden`` sums over the whole vocabulary, so with a sharded vocabulary each
rank can only compute its shard's part. As in Megatron's column-parallel output layer, the sum
over ranks belongs to the layer's input: the hidden states enter the tensor-parallel region
through an op that is the identity forward and all-reduces the gradient backward (Megatron's
``copy_to_tensor_model_parallel_region``, or :func:`copy_to_tensor_parallel_region` here).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlops._checks import check_chunk_size, check_same_device, compute_dtype, shape_error
from rlops.distributed.groups import group_rank_size
from rlops.logprobs import _shard, _tp
from rlops.logprobs._inputs import (
    check_flags,
    check_keep_mask,
    check_logits,
    check_target,
    check_temperature,
    default_chunk,
)
from rlops.logprobs.fused import (
    checked_sampler,
    chunk_grad,
    chunk_grads,
    chunk_stats,
    gather_stats,
    grad_inputs,
    logits_grad_with_graph,
    outputs,
    vocab_layout,
)

__all__ = ["copy_to_tensor_parallel_region", "linear_logprobs_and_entropy"]


def _logits_chunk(h: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, temperature: float):
    """``(h @ weightᵀ)`` in the inputs' dtype (as a materialised output layer), then ``/ τ``."""
    z = (h @ weight.T).to(dtype)
    return z.div_(temperature) if temperature != 1.0 else z


def _grads_by_rows(
    h2, weight, dtype, grad_h, grad_w, over_support, tgt, start, v_local, chunk, keep_rows, thr,
    saved, gl, ge, temperature,
):
    """The backward over token chunks of the whole vocabulary row, in the forward's chunks:
    each chunk's logits have the forward's bits, so that the saved threshold of the sampler's
    support selects the same tokens."""
    for i, j, g in chunk_grads(
        lambda i, j: (_logits_chunk(h2[i:j], weight, dtype, temperature), True),
        tgt, start, v_local, chunk, keep_rows, thr, over_support, saved, gl, ge, temperature,
    ):  # fmt: skip
        g = g.to(h2.dtype)
        hc = h2[i:j]
        if grad_h is not None:
            torch.mm(g, weight, out=grad_h[i:j])
        if grad_w is not None:
            if grad_w.dtype == g.dtype:
                grad_w.addmm_(g.T, hc)
            else:
                grad_w += g.T @ hc


_MIN_TILE_VOCAB = 256


def _grads_by_tiles(
    h2, weight, dtype, grad_h, grad_w, tgt, start, v_local, chunk, keep_rows, thr, saved, gl, ge,
    temperature,
):
    """The backward over ``[tokens, vocabulary]`` tiles of the forward chunk's size (no sampler
    threshold: every tile's gradient is local, given the saved per-token statistics).

    A tile spans as many tokens as fit (all of them when they do) and a slice of the
    vocabulary, so the weight and its gradient are read and written once per token block
    rather than once per chunk: with a 152K vocabulary a chunk holds ~55 tokens, and streaming
    the weight (311 MiB at H = 512) and its gradient per chunk made the backward memory-bound.
    """
    n = h2.shape[0]
    budget = chunk * v_local  # elements of one forward chunk
    vb = min(v_local, max(_MIN_TILE_VOCAB, budget // max(n, 1)))
    ct = max(1, min(n, budget // vb))
    inv_tau = 1.0 / temperature
    for i in range(0, n, ct):
        j = min(i + ct, n)
        hc = h2[i:j]
        dst = None if grad_h is None else grad_h[i:j]
        # half inputs: the hidden gradient's rows summed over the tiles in float32
        acc = None if dst is None or dst.dtype == dtype else torch.zeros_like(dst, dtype=dtype)
        for v0 in range(0, v_local, vb):
            v1 = min(v0 + vb, v_local)
            wb = weight[v0:v1]
            tile_keep = None
            if keep_rows is not None:
                tile_keep = lambda a, b, v0=v0, v1=v1: keep_rows(a, b)[:, v0:v1]  # noqa: E731
            g = chunk_grad(
                i, j,
                lambda a, b, wb=wb: (_logits_chunk(h2[a:b], wb, dtype, temperature), True),
                tgt, start + v0, v1 - v0, tile_keep, None, False, saved, gl, ge, inv_tau,
            ).to(h2.dtype)  # fmt: skip
            if acc is not None:
                acc += g @ wb
            elif dst is not None:
                if v0 == 0:
                    torch.mm(g, wb, out=dst)
                else:
                    dst.addmm_(g, wb)
            if grad_w is not None:
                if grad_w.dtype == g.dtype:
                    grad_w[v0:v1].addmm_(g.T, hc)
                else:
                    grad_w[v0:v1] += g.T @ hc
        if acc is not None:
            dst.copy_(acc)


class _FusedLinearLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        target,
        keep,
        temperature,
        with_entropy,
        entropy_grad,
        group,
        chunk,
        start,
        sampler,
        over_support,
    ):
        _, world = group_rank_size(group)
        v_local = weight.shape[0]
        h2 = hidden.reshape(-1, hidden.shape[-1])
        tgt = target.reshape(-1)
        n = h2.shape[0]
        dtype = compute_dtype(hidden.dtype)
        chunk = chunk or default_chunk(n, v_local, hidden.device, linear=True)
        masked = keep is not None or (sampler is not None and not over_support)
        keep2 = None if keep is None else keep.reshape(-1, v_local)
        stats = torch.empty(
            (n, _shard.n_columns(masked, with_entropy)), dtype=dtype, device=hidden.device
        )
        thr = chunk_stats(
            lambda i, j: (_logits_chunk(h2[i:j], weight, dtype, temperature), True),
            tgt, start, v_local, chunk, None if keep2 is None else (lambda i, j: keep2[i:j]),
            sampler, over_support, with_entropy, group, world, stats,
        )  # fmt: skip
        logp, ent, saved = _shard.merge(gather_stats(stats, group, world), masked, with_entropy)
        ctx.set_materialize_grads(False)
        ctx.meta = (temperature, start, chunk, world, over_support)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            packed = _shard.pack_saved(saved, masked, entropy_grad)
            ctx.save_for_backward(hidden, weight, target, keep, thr, *packed)
        return outputs(ctx, logp, ent, hidden.shape[:-1], entropy_grad)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        temperature, start, chunk, world, over_support = ctx.meta
        hidden, weight, target, keep, thr, *saved = ctx.saved_tensors
        nones = (None,) * 10
        dtype = compute_dtype(hidden.dtype)
        inputs = grad_inputs(saved, g_logp, g_ent, dtype)
        if inputs is None:
            return (None, None, *nones)
        saved, gl, ge = inputs
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        v_local = weight.shape[0]
        h2 = hidden.reshape(-1, hidden.shape[-1])
        tgt = target.reshape(-1)
        keep2 = None if keep is None else keep.reshape(-1, v_local)
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward
            op = "linear_logprobs_and_entropy"
            # The logits chunk by chunk, as in the forward: the same bits, so that the saved
            # threshold selects the same support.
            rows = [h2[i : i + chunk] @ weight.T for i in range(0, h2.shape[0], chunk)]
            logits = torch.cat(rows) if rows else h2 @ weight.T
            g = logits_grad_with_graph(
                logits, tgt, keep2, temperature, gl, ge, world, op, thr, over_support
            )
            grad_h = (g @ weight).view(hidden.shape) if need_h else None
            return (grad_h, g.T @ h2 if need_w else None, *nones)
        grad_h = torch.empty_like(h2, memory_format=torch.contiguous_format) if need_h else None
        # The weight gradient sums over all chunks: accumulate in float32 for half inputs.
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        keep_rows = None if keep2 is None else (lambda i, j: keep2[i:j])
        args = (tgt, start, v_local, chunk, keep_rows, thr, saved, gl, ge, temperature)
        if thr is None:
            _grads_by_tiles(h2, weight, dtype, grad_h, grad_w, *args)
        else:
            _grads_by_rows(h2, weight, dtype, grad_h, grad_w, over_support, *args)
        if need_h:
            grad_h = grad_h.view(hidden.shape)
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return (grad_h, grad_w, *nones)


def linear_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    keep_mask: torch.Tensor | None = None,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    entropy_over_support: bool = False,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    group: object = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Log-probs and entropy of ``softmax(hidden @ weightᵀ / τ)`` without building the logits.

    Equal to ``logprobs_and_entropy(hidden @ weight.T, target, ...)`` (the matmul in the
    inputs' dtype, as a materialised output layer computes it), but only ``[chunk, V_local]``
    logits exist at a time, in the forward and again in the backward:

    .. math::

        z = h W^\top / \tau, \qquad \log p_y = z_y - \operatorname{lse}(z), \qquad
        H = \operatorname{lse}(z) - \sum_v \operatorname{softmax}(z)_v\, z_v .

    Vocabulary-parallel over ``group``: rank ``r`` holds the rows of the output weight for the
    ids that follow the shards of ranks ``< r`` (``[r·V_local, (r+1)·V_local)`` for equal
    shards). The forward issues one collective for the statistics, after the consistency check
    of :func:`rlops.logprobs.logprobs_and_entropy` (15 numbers per rank, the hidden size among
    them; ``RLOPS_TP_CHECK=0`` skips it and then requires equal shards); the backward issues
    none. Double backward (``create_graph=True``) is supported in one process and raises
    RuntimeError with a group of more than one rank. Every rank
    returns the full ``(logp, entropy)``, the gradient of its own ``weight`` shard, and its
    shard's *partial* gradient of ``hidden``: the full gradient is the sum over ranks, which the
    column-parallel layer's input op performs (Megatron's
    ``copy_to_tensor_model_parallel_region``, or :func:`copy_to_tensor_parallel_region`).

    Args:
        hidden: ``[..., H]`` (typically ``[N, H]``) float16 / bfloat16 / float32 / float64.
        weight: ``[V_local, H]``, the output layer's weight (its shard), same dtype as hidden.
        target: ``[...]`` integer ids in the global vocabulary ``[0, Σ_r V_local_r)``.
        temperature: ``> 0``; divides the logits.
        keep_mask: ``[..., V_local]`` bool (the support as a mask, e.g. from the engine), read
            chunk by chunk: the log-prob over the kept logits (the target always kept), the
            entropy over all. Not with the sampler filters.
        top_k, top_p, min_p, entropy_over_support: the sampler's support, rebuilt per token
            chunk from the chunk's logits, as in :func:`rlops.logprobs.logprobs_and_entropy`
            (under a group: one more all-gather of ``[N, top_k + 2]`` candidates for an int
            ``top_k`` or ``min_p`` alone; for ``top_p`` without ``top_k`` or a per-token
            ``top_k``, the radix select's fixed number of all-reduces, each round one more
            pass over the chunks that recomputes each chunk's matmul ``hidden @ weightᵀ``).
        with_entropy: if False, skip the entropy and return ``None`` for it.
        entropy_grad: if False, the entropy is returned detached and nothing is saved for its
            backward (use it when the entropy is only logged).
        group: the tensor-parallel process group, or None (one process, no collective).
        chunk_size: tokens per chunk (``>= 1``); None picks a bound of 32 MiB per
            ``[chunk, V_local]`` float32 buffer on CPU and 128 MiB on accelerators.

    Returns:
        ``(logp, entropy)``, each ``[...]``, float32 (float64 for float64 inputs); entropy is
        None when ``with_entropy=False``. Differentiable w.r.t. ``hidden`` and ``weight``; the
        weight gradient is accumulated in float32 for half-precision weights.

    Example:
        >>> import torch
        >>> from rlops.logprobs import linear_logprobs_and_entropy
        >>> hidden = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
        >>> weight = torch.tensor([[2.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # V = 3, H = 2
        >>> logp, ent = linear_logprobs_and_entropy(hidden, weight, torch.tensor([0, 2]))
        >>> logp, ent
        (tensor([-0.2395, -1.0986]), tensor([0.6656, 1.0986]))
    """
    rank, world = group_rank_size(group)
    checked = world > 1 and _tp.check_enabled()
    try:
        hidden, weight, target, keep_mask, temperature = _checked(
            hidden, weight, target, keep_mask, temperature, with_entropy, entropy_grad, chunk_size
        )
        sampler = checked_sampler(
            "hidden", hidden, top_k, top_p, min_p, keep_mask, entropy_over_support
        )
    except (TypeError, ValueError) as exc:
        if checked:  # the other ranks are about to exchange headers: join them, then raise
            _tp.fail_together(group, world, exc, getattr(hidden, "device", None))
        raise
    v_local = weight.shape[0]
    if checked:
        call = _tp.Call(
            op="linear_logprobs_and_entropy",
            v_local=v_local,
            tokens=target.numel(),
            hidden=weight.shape[1],
            dtype=hidden.dtype,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            masked=keep_mask is not None,
            temperature=temperature,
            sampler=_tp.sampler_fields(top_k, top_p, min_p, entropy_over_support),
        )
    else:
        call = None
    start = vocab_layout(group, rank, world, v_local, call, target, sampler)
    logp, ent = _FusedLinearLogprobsEntropy.apply(
        hidden,
        weight,
        target,
        keep_mask,
        temperature,
        with_entropy,
        entropy_grad,
        group,
        chunk_size,
        start,
        sampler,
        entropy_over_support,
    )
    return logp, (ent if with_entropy else None)


def _checked(
    hidden, weight, target, keep_mask, temperature, with_entropy, entropy_grad, chunk_size
):
    """This rank's own argument checks: ``(hidden, weight, target as int64, keep_mask,
    temperature)``."""
    hidden = check_logits("hidden", hidden)
    weight = check_logits("weight", weight)
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise shape_error(
            "weight", f"[V_local, H] with V_local >= 1 and H = {hidden.shape[-1]}", weight.shape
        )
    temperature = check_temperature(temperature)
    check_flags(with_entropy=with_entropy, entropy_grad=entropy_grad)
    check_chunk_size(chunk_size)
    target = check_target(
        target, hidden.shape[:-1], "[...] like hidden[..., 0] " + str(list(hidden.shape[:-1]))
    )
    keep_mask = check_keep_mask(
        keep_mask, (*hidden.shape[:-1], weight.shape[0]), "hidden @ weight.T"
    )
    check_same_device("hidden", hidden, weight=weight, target=target, keep_mask=keep_mask)
    return hidden, weight, target, keep_mask, temperature


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: object = None) -> torch.Tensor:
    """Identity in the forward; all-reduce (sum) of the gradient over ``group`` in the backward.

    The input op of a column-parallel layer: apply it to the replicated hidden states before
    :func:`linear_logprobs_and_entropy` with a vocabulary-sharded weight, unless the framework
    already does (Megatron's ``copy_to_tensor_model_parallel_region``), so that every rank gets
    the full gradient of ``hidden``. ``group=None``: the identity both ways.

    Example:
        >>> import torch
        >>> x = torch.ones(2, requires_grad=True)
        >>> copy_to_tensor_parallel_region(x).sum().backward()
        >>> x.grad
        tensor([1., 1.])
    """
    group_rank_size(group)
    return _CopyToTensorParallelRegion.apply(x, group)
