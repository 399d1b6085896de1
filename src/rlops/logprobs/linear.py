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

The chunk loops are the engine's (:mod:`rlops.logprobs._engine`), as for the op on logits; this
op's producer multiplies a chunk of hidden states by the weight, and its backward accumulates
the gradients of ``hidden`` and ``weight``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from typing_extensions import Unpack  # torch's own dependency (typing.Unpack: 3.11+)

from rlops._checks import check_chunk_size, check_same_device, shape_error
from rlops._types import Group
from rlops.distributed.groups import group_rank_size
from rlops.logprobs import _engine
from rlops.logprobs._checks import (
    check_flags,
    check_keep_mask,
    check_logits,
    check_row_mask,
    check_support,
    check_target,
    check_temperature,
    default_chunk,
)
from rlops.logprobs._head import check_logit_scale, check_softcap
from rlops.logprobs._options import LogprobOptions
from rlops.logprobs._plan import Plan

__all__ = ["copy_to_tensor_parallel_region", "linear_logprobs_and_entropy"]

_OP = "linear_logprobs_and_entropy"
# The narrowest vocabulary slice of a backward tile.
_MIN_TILE_VOCAB = 256


# Every matmul of the logits has a multiple of this many rows (zero rows pad the last block).
ROW_ALIGN = 16


def _linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``h [C, H] @ weightᵀ``, then ``+ bias``, each in the inputs' dtype (a fresh tensor).

    Batch invariance: the matmul always has a multiple of :data:`ROW_ALIGN` rows, ``h``
    padded with zero rows when ``C`` is not one (the result is the ``C`` rows). A BLAS picks
    its kernel by the number of rows of the call, and rows left over by its row tiles (on
    MKL: a call of 1–3 rows, the last ``C mod 4`` of a thread's rows) are summed by another
    kernel, about one ulp apart; with every call a multiple of 16 rows each row's logits are
    the same bits whatever ``C``, the row's place in the call and the other rows (measured
    with MKL and oneDNN in float32 / float64 / bfloat16, at 1 and 2 threads, where the two
    thread counts agree too: ``tests/testing/test_batch_invariance.py``).

    The bias is added after the matmul, not inside it (``addmm``): an elementwise add has the
    same bits however the rows and columns are tiled, whereas a fused ``addmm`` rounds its
    partial sums differently per block shape, and the backward's tiles must see the logits
    the forward's chunks saw (their mismatch enters every gradient)."""
    c = h.shape[0]
    pad = -c % ROW_ALIGN
    padded = torch.compiler.is_compiling() or pad != 0  # traced: no branch on a symbolic C
    if padded:
        h = torch.cat([h, h.new_zeros(pad, h.shape[1])])
    z = h @ weight.T
    if padded:
        z = z[:c]
    return z if bias is None else z.add_(bias)


class _Matmul(_engine.Producer):
    """Chunks of rows of ``hidden @ weightᵀ (+ bias)`` in the inputs' dtype (as a materialised
    output layer, :func:`_linear`), then in the compute dtype through the head's map (scale,
    softcap, ``/ τ``: :class:`rlops.logprobs._head.Head`); a fresh buffer each time."""

    def __init__(
        self,
        h2: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        plan: Plan,
        row_block: int | None = None,
    ) -> None:
        self.h2, self.weight, self.bias = h2, weight, bias
        self.dtype, self.head = plan.dtype, plan.head
        self.row_block = row_block

    def logits(self, i: int, j: int) -> tuple[torch.Tensor, bool]:
        return self.head.scaled(self._raw(i, j), self.dtype, True)

    def sloped(self, i: int, j: int) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        if self.head.softcap is None:
            return (*self.logits(i, j), None)
        z, slope = self.head.sloped(self._raw(i, j), self.dtype, True)
        return z, True, slope

    def _raw(self, i: int, j: int) -> torch.Tensor:
        """Rows ``i:j``. With ``row_block`` (the forward's chunk; ``i`` a multiple of it), one
        matmul per block of the forward's rows: a BLAS picks its kernel, and so the rounding of
        every logit, by the number of rows of the call, so these are the forward's bits
        (a slice of the vocabulary changes only the columns, not how each logit is summed)."""
        if self.row_block is None or j - i <= self.row_block:
            z = _linear(self.h2[i:j], self.weight, self.bias)
        else:
            blocks = range(i, j, self.row_block)
            z = torch.cat(
                [_linear(self.h2[a : min(a + self.row_block, j)], self.weight, self.bias)
                 for a in blocks]
            )  # fmt: skip
        return z


def _add_weight_grad(grad_w: torch.Tensor, g: torch.Tensor, hc: torch.Tensor) -> None:
    """``grad_w += gᵀ · hc`` (``grad_w`` in float32 for half inputs)."""
    if grad_w.dtype == g.dtype:
        grad_w.addmm_(g.T, hc)
    else:
        grad_w += g.T @ hc


def _grads(
    plan: Plan,
    h2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> None:
    """The backward's gradients into ``grads`` (the buffers of the hidden, weight and bias
    gradients; None: not asked for), over ``[tokens, vocabulary]`` tiles.

    With the sampler's saved threshold, the tiles are the forward's chunks of whole vocabulary
    rows: each chunk's logits have the forward's bits, so that the threshold selects the same
    tokens. Otherwise every tile's gradient is local, given the saved per-token statistics: a
    tile spans as many whole forward chunks of tokens as fit (all of them when they do) and a
    slice of the vocabulary of the forward chunk's size, so the weight and its gradient are
    read and written once per token block rather than once per chunk: with a 152K vocabulary
    a chunk holds ~55 tokens, and streaming the weight and its gradient per chunk made the
    backward memory-bound. The tile's logits are made chunk by chunk (:class:`_Matmul` with
    ``row_block``), so they have the forward's bits: recomputed softmax values that differ
    from the forward's by an ulp of the logits, against statistics saved from the forward,
    cost the gradients several times the reference's error.
    """
    grad_h, grad_w, grad_b = grads
    n, v_local = plan.rows, plan.v_local
    if plan.threshold is not None:  # the forward's chunks of whole rows
        tiles, plans = [(0, v_local)], [plan]
        producers = [_Matmul(h2, weight, bias, plan)]
        blocks = [(i, i + plan.chunk) for i in plan.starts]
    else:
        budget = plan.chunk * v_local  # elements of one forward chunk
        vb = min(v_local, max(_MIN_TILE_VOCAB, budget // max(n, 1)))
        if plan.chunk is plan.rows:  # one chunk (as under torch.compile): one block of all rows
            ct, row_block = max(n, 1), None
        else:  # whole forward chunks per block, each tile's logits made chunk by chunk
            row_block = max(plan.chunk, 1)
            ct = max(row_block, (budget // vb) // row_block * row_block)
        tiles = [(v0, min(v0 + vb, v_local)) for v0 in range(0, v_local, vb)]
        plans = [plan.tile(v0, v1) for v0, v1 in tiles]
        producers = [
            _Matmul(h2, weight[v0:v1], None if bias is None else bias[v0:v1], plan, row_block)
            for v0, v1 in tiles
        ]
        blocks = [(i, min(i + ct, n)) for i in range(0, n, ct)]
    for i, j in blocks:
        dst = None if grad_h is None else grad_h[i:j]
        # half inputs: the hidden gradient's rows summed over several tiles in float32
        acc = None
        if dst is not None and dst.dtype != plan.dtype and len(tiles) > 1:
            acc = torch.zeros_like(dst, dtype=plan.dtype)
        for (v0, v1), producer, tile in zip(tiles, producers, plans, strict=True):
            g = producer.grad(tile, i, j)
            tile.zero_masked(g, i)
            if grad_b is not None:  # the sum over the rows, in the compute dtype
                grad_b[v0:v1] += g.sum(dim=0)
            g = g.to(h2.dtype)
            wb = producer.weight
            if acc is not None:
                acc += g @ wb
            elif dst is not None:
                if v0 == 0:
                    torch.mm(g, wb, out=dst)
                else:
                    dst.addmm_(g, wb)
            if grad_w is not None:
                _add_weight_grad(grad_w[v0:v1], g, h2[i:j])
        if acc is not None and dst is not None:
            dst.copy_(acc)


class _FusedLinearLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, per_token, plan):
        # ``per_token``: the non-differentiable per-token tensors (the target, the keep mask,
        # the sampler's per-token options, the CSR support), as one tuple (None where absent)
        target, keep, sel, s_rows, s_ids = per_token
        plan = plan.bound(target, keep, sel, None if s_rows is None else (s_rows, s_ids))
        producer = _Matmul(_rows(hidden, plan), weight, bias, plan)
        inputs = (hidden, weight, bias, target, keep, sel, s_rows, s_ids)
        return _engine.forward(ctx, plan, producer, inputs)

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_squares):
        nothing = (None,) * 5
        restored = _engine.restore(ctx, g_logp, g_ent)
        if restored is None:
            return nothing
        with _no_autocast(restored[0][0]):  # the forward's bits, whatever autocast says here
            return _FusedLinearLogprobsEntropy._backward(ctx, *restored)

    @staticmethod
    def _backward(ctx, inputs, plan):
        nothing = (None,) * 5
        hidden, weight, bias = inputs[:3]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        h2 = _rows(hidden, plan)
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward
            # The logits chunk by chunk, as in the forward: the same bits, so that the saved
            # threshold selects the same support.
            rows = [_linear(h2[i : i + plan.chunk], weight, bias) for i in plan.starts]
            logits = torch.cat(rows) if rows else _linear(h2, weight, bias)
            g = _engine.grad_with_graph(plan, logits, _OP, compacted=True)
            grad_h = _scattered(g @ weight, hidden, plan) if need_h else None
            grad_b = g.sum(dim=0) if need_b else None
            return grad_h, (g.T @ h2 if need_w else None), grad_b, *nothing[3:]
        grad_h = torch.empty_like(h2, memory_format=torch.contiguous_format) if need_h else None
        # The weight and bias gradients sum over all chunks: accumulated in float32 for half
        # inputs.
        grad_w = grad_b = None
        if need_w:
            grad_w = torch.zeros(weight.shape, dtype=plan.dtype, device=weight.device)
        if need_b:
            grad_b = torch.zeros(bias.shape, dtype=plan.dtype, device=bias.device)
        _grads(plan, h2, weight, bias, (grad_h, grad_w, grad_b))
        return (
            None if grad_h is None else _scattered(grad_h, hidden, plan),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            *nothing[3:],
        )


def _autocast(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Under autocast (``torch.autocast`` on the hidden states' device), the three as
    ``F.linear`` would multiply them: each float32 / float16 / bfloat16 tensor cast to the
    autocast dtype (differentiably: the gradients come back in each one's own dtype), float64
    left as it is. Elsewhere unchanged."""
    if not isinstance(hidden, torch.Tensor) or not _autocast_on(hidden.device.type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(hidden.device.type)

    def cast(t: Any) -> Any:  # not yet checked: anything that is not a tensor stays as given
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
            return t.to(dtype)
        return t

    return cast(hidden), cast(weight), cast(bias)


def _no_autocast(x: torch.Tensor) -> AbstractContextManager:
    """Autocast off on ``x``'s device where it is on (the op's own dtypes, forward and
    backward), else nothing."""
    if _autocast_on(x.device.type):
        return torch.autocast(x.device.type, enabled=False)
    return nullcontext()


def _autocast_on(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (never for a type without autocast: meta)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _rows(hidden: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The plan's rows of ``hidden`` as ``[N, H]``: the valid rows only when a row mask was
    compacted (a copy of ``[n_valid, H]``, small beside the logits)."""
    h2 = hidden.reshape(-1, hidden.shape[-1])
    return h2 if plan.rows_of is None else h2.index_select(0, plan.rows_of)


def _scattered(grad_h: torch.Tensor, hidden: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The hidden gradient of the plan's rows as ``hidden``'s shape, zero on dropped rows."""
    if plan.rows_of is not None:
        full = grad_h.new_zeros(plan.total, grad_h.shape[1])
        grad_h = full.index_copy(0, plan.rows_of, grad_h)
    return grad_h.view(hidden.shape)


class _Options(LogprobOptions, total=False):
    """The keyword arguments of :func:`linear_logprobs_and_entropy` beside the two that choose
    its outputs (for the overloads)."""

    bias: torch.Tensor | None


@overload
def linear_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    with_entropy: Literal[True] = ...,
    with_sum_pi_squared: Literal[False] = ...,
    **options: Unpack[_Options],
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def linear_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    with_entropy: Literal[False],
    with_sum_pi_squared: Literal[False] = ...,
    **options: Unpack[_Options],
) -> tuple[torch.Tensor, None]: ...
@overload
def linear_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    with_entropy: bool = ...,
    with_sum_pi_squared: Literal[False] = ...,
    **options: Unpack[_Options],
) -> tuple[torch.Tensor, torch.Tensor | None]: ...
@overload
def linear_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    with_entropy: Literal[True] = ...,
    with_sum_pi_squared: Literal[True],
    **options: Unpack[_Options],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
@overload
def linear_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    with_entropy: Literal[False],
    with_sum_pi_squared: Literal[True],
    **options: Unpack[_Options],
) -> tuple[torch.Tensor, None, torch.Tensor]: ...
@overload
def linear_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    with_entropy: bool = ...,
    with_sum_pi_squared: Literal[True],
    **options: Unpack[_Options],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]: ...
@overload
def linear_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    with_entropy: bool = ...,
    with_sum_pi_squared: bool = ...,
    **options: Unpack[_Options],
) -> _engine.Outputs: ...


def linear_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    with_entropy: bool = True,
    with_sum_pi_squared: bool = False,
    **options: Unpack[LogprobOptions],
) -> _engine.Outputs:
    """Log-probs and entropy of ``softmax((hidden @ weightᵀ + bias) / τ)`` without building the
    logits.

    Equal to ``logprobs_and_entropy(hidden @ weight.T + bias, target, ...)`` (the matmul, then
    the bias, in the inputs' dtype, as a materialised output layer computes them; ``F.linear``
    fuses the two and may round once less), but only ``[chunk, V_local]`` logits exist at a
    time, in the forward and again in the backward (the bias is added to each chunk there),
    with ``lse(z) = log Σ_v exp(z_v)``::

        z = (h·Wᵀ + b) / τ        log p_y = z_y − lse(z)        H = lse(z) − Σ_v softmax(z)_v · z_v

    Heads that scale or cap their logits (Cohere, Granite, Gemma-2/3), in Hugging Face's order:
    ``x = h Wᵀ + b``, then ``x·s`` (``logit_scale``), then ``c·tanh(x/c)``
    (``final_logit_softcapping``), then ``/ τ``, in the compute dtype chunk by chunk, exactly
    as :func:`rlops.logprobs.logprobs_and_entropy` defines them; the gradients of ``hidden``,
    ``weight`` and ``bias`` go through ``∂z/∂x = s·(1 − tanh²(s·x/c))/τ``, one more
    ``[tile, V]`` temporary with a softcap, never ``[N, V]``.

    Autocast: under ``torch.autocast`` on the hidden states' device, the hidden states, the
    weight and the bias are multiplied in autocast's dtype, as ``F.linear`` would (each
    float32 / float16 / bfloat16 one cast to it, float64 left alone; their gradients return in
    their own dtypes, those of a cast float32 weight rounded through the autocast dtype, as
    ``F.linear``'s are), and the softmax statistics are float32 as for half-precision inputs.
    Autocast is off inside the op, forward and backward, so the backward recomputes the
    forward's logits whether or not it runs under autocast. Without autocast, ``weight`` and
    ``bias`` must have ``hidden``'s dtype.

    Batch invariance (CPU): every matmul of the logits has a multiple of 16 rows (a chunk's
    last block padded with zero rows), because a BLAS sums the rows a call leaves outside its
    row tiles with another kernel (MKL: about one float32 ulp apart); so a row's log-prob and
    entropy are the same bits whatever the other rows, N, ``chunk_size`` and padding rows
    (measured with MKL and oneDNN at 1 and 2 threads, which agree). The cost is the padding
    rows: none for the default chunks (multiples of 16) but in the last one; an explicit
    ``chunk_size`` that is no multiple of 16 pays for them in every chunk, and fewer than 16
    rows cost the matmul of 16 (N = 1, V = 32000, H = 512: about 2x the forward and backward
    of a one-row matrix-vector product). The gradient of the
    hidden states is within the rule, not bitwise: its sum over the vocabulary runs in tiles
    whose width follows N.

    Vocabulary-parallel over ``group``: rank ``r`` holds the rows of the output weight for the
    ids that follow the shards of ranks ``< r`` (``[r·V_local, (r+1)·V_local)`` for equal
    shards). The forward issues one collective for the statistics, after the consistency check
    of :func:`rlops.logprobs.logprobs_and_entropy` (64 numbers per rank, the hidden size among
    them; ``RLOPS_TP_CHECK=0`` skips it and then requires equal shards); the backward issues
    none. Double backward (``create_graph=True``) is supported in one process and raises
    RuntimeError with a group of more than one rank. Every rank
    returns the full ``(logp, entropy)``, the gradient of its own ``weight`` shard, and its
    shard's *partial* gradient of ``hidden``: the full gradient is the sum over ranks, which the
    column-parallel layer's input op performs (Megatron's
    ``copy_to_tensor_model_parallel_region``, or :func:`copy_to_tensor_parallel_region`).

    Args:
        hidden: ``[..., H]`` (typically ``[N, H]``) float16 / bfloat16 / float32 / float64.
        weight: ``[V_local, H]``, the output layer's weight (its shard), same dtype as hidden
            (under autocast: any of autocast's, above).
        bias: ``[V_local]``, the output layer's bias (its shard, the entries of the ids of
            ``weight``'s rows), same dtype and device as hidden, or None (no bias). Its
            gradient is the logits' gradient summed over the tokens, chunk by chunk
            (accumulated in float32 for half precision).
        target: ``[...]`` integer ids in the global vocabulary ``[0, Σ_r V_local_r)``.
        with_entropy: if False, skip the entropy and return ``None`` for it.
        with_sum_pi_squared: also return ``Σ_v π_v²`` of the log-prob's distribution,
            detached, as :func:`rlops.logprobs.logprobs_and_entropy` defines it (one more
            column in the same collective under a group).

        **options: the keyword options of :class:`~rlops.logprobs.LogprobOptions`, below.

    Other Parameters:
        temperature: ``> 0``; divides the logits, after the scale and the softcap.
        logit_scale: finite ``> 0``; multiplies the logits first (Cohere's ``logit_scale``;
            Granite's ``logits_scaling`` divides them: pass ``1 / logits_scaling``).
        final_logit_softcapping: None (off), or a finite ``c > 0``: the logits become
            ``c·tanh(logits / c)`` after the scale (Gemma-2/3's).
        keep_mask: ``[..., V_local]`` bool (the support as a mask, e.g. from the engine), read
            chunk by chunk: the log-prob over the kept logits (the target always kept), the
            entropy over all. Not with the sampler filters.
        support_ids: the kept sets as CSR, with ``support_offsets`` ``[N + 1]``, exactly as
            in :func:`rlops.logprobs.logprobs_and_entropy` (each chunk's keep mask set from
            its ids; never ``[N, V]``). Not with ``keep_mask`` or the sampler filters.
        support_offsets: see ``support_ids``.
        mask: ``[...]`` bool like ``target``: the rows the loss reads. Where False the
            outputs are exactly 0, ``hidden.grad`` is zero on those rows and nothing reaches
            ``weight.grad`` or ``bias.grad`` from them. On CPU (values read, not compiling)
            only the valid rows are multiplied by the weight, forward and backward (a copy
            of ``hidden[mask]``, ``[n_valid, H]``); elsewhere every row is, with the masked
            ones zeroed (no host read). Under a ``group``: equal on every rank (checked),
            one collective.
        top_k: the sampler's top-k, with ``top_p``, ``min_p`` and ``entropy_over_support``
            its support, rebuilt per token chunk from the chunk's logits, as in
            :func:`rlops.logprobs.logprobs_and_entropy`
            (under a group: one more all-gather of ``[N, top_k + 2]`` candidates for an int
            ``top_k`` or ``min_p`` alone; for ``top_p`` without ``top_k`` or a per-token
            ``top_k``, the radix select's fixed number of all-reduces, each round one more
            pass over the chunks that recomputes each chunk's matmul ``hidden @ weightᵀ``).
        entropy_grad: if False, the entropy is returned detached and nothing is saved for its
            backward (use it when the entropy is only logged).
        group: the tensor-parallel process group, or None (one process, no collective).
        chunk_size: tokens per chunk (``>= 1``); None picks a bound of 32 MiB per
            ``[chunk, V_local]`` float32 buffer on CPU and 128 MiB on accelerators (a multiple
            of 16 rows where it is more).

    Returns:
        ``(logp, entropy)``, each ``[...]``, float32 (float64 for float64 inputs); entropy is
        None when ``with_entropy=False``; with ``with_sum_pi_squared=True`` a third ``[...]``
        output ``Σ_v π_v²`` without gradient. Differentiable w.r.t. ``hidden``, ``weight`` and
        ``bias``; the weight and bias gradients are accumulated in float32 for half-precision
        inputs.

    Example:
        >>> import torch
        >>> from rlops.logprobs import linear_logprobs_and_entropy
        >>> hidden = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
        >>> weight = torch.tensor([[2.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # V = 3, H = 2
        >>> logp, ent = linear_logprobs_and_entropy(hidden, weight, torch.tensor([0, 2]))
        >>> logp, ent
        (tensor([-0.2395, -1.0986]), tensor([0.6656, 1.0986]))
        >>> bias = torch.tensor([0.0, 0.0, 1.0])  # the logits of row 1 become (0, 0, 1)
        >>> linear_logprobs_and_entropy(hidden, weight, torch.tensor([0, 2]), bias=bias)[0]
        tensor([-0.4076, -0.5514])
    """
    hidden, weight, bias = _autocast(hidden, weight, bias)
    given = _engine.Options.given(
        "linear_logprobs_and_entropy",
        options,
        with_entropy=with_entropy,
        with_sum_pi_squared=with_sum_pi_squared,
    )
    inputs, plan, sel = _engine.prepare(
        _OP, hidden, given, lambda: _checked(hidden, weight, bias, target, given)
    )
    with _no_autocast(inputs.x):
        logp, ent, squares = _FusedLinearLogprobsEntropy.apply(
            inputs.x, inputs.weight, inputs.bias, (inputs.target, inputs.keep, *sel), plan
        )
    if with_sum_pi_squared:
        return logp, (ent if with_entropy else None), squares
    return logp, (ent if with_entropy else None)


def _default_chunk(n: int, v_local: int, device: torch.device) -> int | None:
    """The default chunk, rounded down to a multiple of :data:`ROW_ALIGN` rows where it holds
    more (no padding rows but in the last chunk)."""
    chunk = default_chunk(n, v_local, device, linear=True)
    if chunk is None or chunk < ROW_ALIGN or chunk >= n:
        return chunk
    return chunk // ROW_ALIGN * ROW_ALIGN


def _checked(
    hidden: object, weight: object, bias: object, target: object, options: _engine.Options
) -> _engine.Checked:
    """This rank's own argument checks (the sampler's are the engine's)."""
    hidden = check_logits("hidden", hidden)
    weight = check_logits("weight", weight)
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise shape_error(
            "weight", f"[V_local, H] with V_local >= 1 and H = {hidden.shape[-1]}", weight.shape
        )
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise shape_error("bias", f"[V_local] like weight's rows [{weight.shape[0]}]",
                              bias.shape)  # fmt: skip
    temperature = check_temperature(options.temperature)
    logit_scale = check_logit_scale(options.logit_scale)
    softcap = check_softcap(options.final_logit_softcapping)
    check_flags(
        with_entropy=options.with_entropy,
        entropy_grad=options.entropy_grad,
        with_sum_pi_squared=options.with_sum_pi_squared,
    )
    check_chunk_size(options.chunk_size)
    lead = hidden.shape[:-1]
    target = check_target(target, lead, "hidden")
    v_local = weight.shape[0]
    keep_mask = check_keep_mask(options.keep_mask, (*lead, v_local), "hidden @ weight.T")
    mask = check_row_mask(options.mask, lead, "hidden[..., 0]")
    support = check_support(options.support_ids, options.support_offsets, target.numel())
    s_ids, s_offsets = (None, None) if support is None else support
    check_same_device(
        "hidden", hidden, weight=weight, bias=bias, target=target, keep_mask=keep_mask,
        mask=mask, support_ids=s_ids, support_offsets=s_offsets,
    )  # fmt: skip
    n, chunk = target.numel(), options.chunk_size
    return _engine.Checked(
        name="hidden",
        x=hidden,
        weight=weight,
        bias=bias,
        target=target,
        keep=keep_mask,
        temperature=temperature,
        logit_scale=logit_scale,
        softcap=softcap,
        v_local=v_local,
        chunk=chunk if chunk is not None else _default_chunk(n, v_local, hidden.device),
        hidden=weight.shape[1],
        mask=mask,
        support=support,
    )


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


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
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
