"""Fused output layer + log-probs + entropy: ``hidden @ weightᵀ`` chunk by chunk, never ``[N, V]``.

Its producer multiplies a chunk of hidden states by the weight; its backward accumulates the
gradients of ``hidden``, ``weight`` and ``bias`` per ``[tokens, vocabulary]`` tile. The chunk
loops, the collective and the merge are the engine's (:mod:`rlops.logprobs._engine`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any, Literal, overload

import torch
from typing_extensions import Unpack  # torch's own dependency (typing.Unpack: 3.11+)

from rlops.logprobs import _engine, _softmax
from rlops.logprobs._options import ROW_ALIGN, LogprobOptions, Options
from rlops.logprobs._plan import Plan
from rlops.logprobs._tensor_parallel import copy_to_tensor_parallel_region

__all__ = [
    "TokenGrad",
    "copy_to_tensor_parallel_region",
    "linear_logprobs_and_entropy",
    "linear_logprobs_one_pass",
]

_OP = "linear_logprobs_and_entropy"
# The narrowest vocabulary slice of a backward tile.
_MIN_TILE_VOCAB = 256
# Bytes of the weight's rows upcast at a time for wider logits (``logits_dtype``).
_WIDE_WEIGHT_BYTES = 8 << 20


def _linear(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``h [C, H] @ weightᵀ``, then ``+ bias``, each in the inputs' dtype, or in ``dtype``
    (:func:`_wide_matmul`) when given (a fresh tensor). The matmul always has a multiple of
    :data:`ROW_ALIGN` rows (zero rows pad ``h``), so each row's logits are the same bits
    whatever ``C`` (a BLAS picks its kernel by the rows of the call); the bias is added after,
    not in an ``addmm`` (the backward's tiles must see the forward's bits).
    ``docs/design/logprobs.md``: batch invariance."""
    c = h.shape[0]
    pad = -c % ROW_ALIGN
    padded = torch.compiler.is_compiling() or pad != 0  # traced: no branch on a symbolic C
    if padded:
        h = torch.cat([h, h.new_zeros(pad, h.shape[1])])
    z = h @ weight.T if dtype is None else _wide_matmul(h, weight, dtype)
    if padded:
        z = z[:c]
    return z if bias is None else z.add_(bias)


def _wide_matmul(
    h: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``h @ weightᵀ`` ``[C, V]`` in ``dtype`` from narrower operands, never rounded to theirs:
    a product of two half numbers is exact in float32, so the matmul of the upcast operands is
    a float32 accumulation of the exact products. The weight is upcast by blocks of rows of
    ``_WIDE_WEIGHT_BYTES`` (never a whole copy of ``[V, H]``). ``out``: written there."""
    hw = h.to(dtype)
    v, width = weight.shape
    step = max(ROW_ALIGN, _WIDE_WEIGHT_BYTES // (width * dtype.itemsize))
    if step >= v:
        return (
            torch.mm(hw, weight.to(dtype).T, out=out)
            if out is not None
            else hw @ weight.to(dtype).T
        )
    z = hw.new_empty((hw.shape[0], v)) if out is None else out
    for v0 in range(0, v, step):
        z[:, v0 : v0 + step] = hw @ weight[v0 : v0 + step].to(dtype).T
    return z


class _Matmul(_engine.Producer):
    """Chunks of rows of ``hidden @ weightᵀ (+ bias)`` (:func:`_linear`), then through the
    head's map in the compute dtype; a fresh buffer each time, or with ``reuse`` the same
    buffers for every chunk (a chunk is done with before the next is made: no page faults
    per chunk)."""

    def __init__(
        self,
        h2: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        plan: Plan,
        row_block: int | None = None,
        *,
        reuse: bool = False,
    ) -> None:
        self.h2, self.weight, self.bias = h2, weight, bias
        self.dtype, self.head, self.wide = plan.dtype, plan.head, plan.logits_dtype
        self.row_block = row_block
        self.buffers: dict[str, torch.Tensor] | None = {} if reuse else None

    def logits(self, i: int, j: int) -> tuple[torch.Tensor, bool]:
        return self.head.rows(i, j).scaled(self._raw(i, j), self.dtype, True)

    def sloped(self, i: int, j: int) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        if self.head.softcap is None:
            return (*self.logits(i, j), None)
        z, slope = self.head.rows(i, j).sloped(self._raw(i, j), self.dtype, True)
        return z, True, slope

    def _raw(self, i: int, j: int) -> torch.Tensor:
        """Rows ``i:j``; with ``row_block`` (the forward's chunk), one matmul per block of the
        forward's rows: the forward's bits."""
        if self.buffers is not None:
            return self._reused(i, j)
        if self.row_block is None or j - i <= self.row_block:
            z = _linear(self.h2[i:j], self.weight, self.bias, self.wide)
        else:
            blocks = range(i, j, self.row_block)
            z = torch.cat(
                [_linear(self.h2[a : min(a + self.row_block, j)], self.weight, self.bias,
                         self.wide)
                 for a in blocks]
            )  # fmt: skip
        return z

    def _buffer(self, name: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
        assert self.buffers is not None
        buf = self.buffers.get(name)
        if buf is None or buf.shape[0] < rows or buf.dtype != dtype:
            buf = torch.empty((rows, self.weight.shape[0]), dtype=dtype, device=self.h2.device)
            self.buffers[name] = buf
        return buf[:rows]

    def narrowed(self, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A chunk's logit gradient ``g`` in ``dtype`` (the matmuls'); with ``reuse``, in the
        buffer of the raw logits when it has that dtype (they are read no more)."""
        if g.dtype == dtype:
            return g
        raw = None if self.buffers is None else self.buffers.get("z")
        if raw is None or raw.dtype != dtype:
            return g.to(dtype)
        return raw[: g.shape[0]].copy_(g)

    def _reused(self, i: int, j: int) -> torch.Tensor:
        """:func:`_linear`'s rows ``i:j`` (the same bits) in the reused buffers, in the compute
        dtype."""
        h = self.h2[i:j]
        c = h.shape[0]
        pad = -c % ROW_ALIGN
        if pad:
            h = torch.cat([h, h.new_zeros(pad, h.shape[1])])
        out = self._buffer("z", c + pad, self.wide or h.dtype)
        if self.wide is None:
            torch.mm(h, self.weight.T, out=out)
        else:
            _wide_matmul(h, self.weight, self.wide, out=out)
        z = out[:c]
        if self.bias is not None:
            z.add_(self.bias)
        if z.dtype != self.dtype:
            z = self._buffer("cast", c, self.dtype).copy_(z)
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
    """The backward's gradients into ``grads`` (the hidden, weight and bias gradients' buffers;
    None: not asked for), over ``[tokens, vocabulary]`` tiles of the forward chunk's size whose
    logits are made chunk by chunk (the forward's bits); under a sampler threshold, the
    forward's chunks of whole rows. ``docs/design/logprobs.md``: why tiles."""
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
            g = producer.grad(tile, i, j, tile.keep_rows(i, j))
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
            wide = plan.logits_dtype
            rows = [_linear(h2[i : i + plan.chunk], weight, bias, wide) for i in plan.starts]
            logits = torch.cat(rows) if rows else _linear(h2, weight, bias, wide)
            g = _engine.grad_with_graph(plan, logits, _OP, compacted=True).to(h2.dtype)
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
    """Under autocast on the hidden states' device, the three as ``F.linear`` would multiply
    them (float32 / float16 / bfloat16 cast to autocast's dtype, differentiably; float64 as it
    is); elsewhere unchanged."""
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

    Equal to :func:`~rlops.logprobs.logprobs_and_entropy` on ``hidden @ weight.T + bias`` (the
    matmul, then the bias, in the inputs' dtype), with the same head's map, support, sampler
    and options, but only ``[chunk, V_local]`` logits exist at a time, forward and backward::

        z = (h·Wᵀ + b) / τ        log p_y = z_y − lse(z)        H = lse(z) − Σ_v softmax(z)_v · z_v

    Under ``torch.autocast`` the three inputs are multiplied in autocast's dtype, as
    ``F.linear`` would. Every matmul has a multiple of 16 rows, so a row's results are the
    same bits whatever the batch (CPU). Vocabulary-parallel over ``group`` as the op on logits:
    each rank gets its weight shard's gradient and its shard's *partial* hidden gradient,
    summed by the layer's input op (:func:`copy_to_tensor_parallel_region`, Megatron's
    ``copy_to_tensor_model_parallel_region``). Autocast, batch invariance, memory and the
    backward's tiles: ``docs/design/logprobs.md``.

    Args:
        hidden: ``[..., H]`` float16 / bfloat16 / float32 / float64.
        weight: ``[V_local, H]``, the output layer's weight (its shard), hidden's dtype.
        target: ``[...]`` integer ids in the global vocabulary ``[0, Σ_r V_local_r)``.
        bias: ``[V_local]``, the output layer's bias (its shard), hidden's dtype, or None.
        with_entropy: if False, skip the entropy and return None for it.
        with_sum_pi_squared: also return ``Σ_v π_v²`` of the log-prob's distribution, detached.
        **options: :class:`~rlops.logprobs.LogprobOptions`, as for the op on logits (the
            default ``chunk_size`` bounds a ``[chunk, V_local]`` float32 buffer to 32 MiB on
            CPU, 128 MiB on accelerators). ``logits_dtype=torch.float32``: half operands,
            float32 logits (never rounded to 16 bits), no float32 copy of the weight.

    Returns:
        ``(logp, entropy)``, each ``[...]`` float32 (float64 for float64 inputs or
        ``logits_dtype``),
        differentiable w.r.t. ``hidden``, ``weight`` and ``bias``; ``entropy`` is None with
        ``with_entropy=False``; with ``with_sum_pi_squared=True`` a third ``[...]`` output
        without gradient.

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
    given = Options.given(
        _OP, options, with_entropy=with_entropy, with_sum_pi_squared=with_sum_pi_squared
    )
    inputs, plan, sel = _engine.prepare(
        _OP, given, "hidden", hidden, target, weight=weight, bias=bias
    )
    with _no_autocast(inputs.x):
        logp, ent, squares = _FusedLinearLogprobsEntropy.apply(
            inputs.x, inputs.weight, inputs.bias, (inputs.target, inputs.keep, *sel), plan
        )
    if with_sum_pi_squared:
        return logp, (ent if with_entropy else None), squares
    return logp, (ent if with_entropy else None)


#: ``token_grad(index, logp, entropy) -> (∂L/∂logp, ∂L/∂H)``: a chunk's ``[C]`` flat token
#: indices and its ``[C]`` log-probs and entropies in, their ``[C]`` gradients out.
TokenGrad = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]
]


class _Kept(_engine.Producer):
    """A chunk's logits made once, then read by its statistics (kept intact) and by its
    gradient, their last reader (which may overwrite them)."""

    def __init__(self, inner: _Matmul) -> None:
        self.inner, self.key = inner, (-1, -1)

    def sloped(self, i: int, j: int) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        if self.key != (i, j):
            self.z, _, self.slope = self.inner.sloped(i, j)
            self.key = (i, j)
            return self.z, False, self.slope
        self.key = (-1, -1)  # the second reader is the last
        return self.z, True, self.slope

    def logits(self, i: int, j: int) -> tuple[torch.Tensor, bool]:
        return self.sloped(i, j)[:2]


def linear_logprobs_one_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    token_grad: TokenGrad,
    *,
    bias: torch.Tensor | None = None,
    with_entropy: bool = True,
    **options: Unpack[LogprobOptions],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`linear_logprobs_and_entropy` and the gradients of a loss of its outputs, in one
    pass over the vocabulary: each chunk's logits are made once, give the chunk's log-probs and
    entropies, then ``token_grad`` gives the loss's per-token gradients and the same logits
    give the chunk's share of the hidden, weight and bias gradients (three matmuls in all; the
    op and its backward take four).

    For a loss whose gradient with respect to a token's log-prob and entropy depends on that
    token alone (given numbers known before the pass, as a loss's normaliser); one process
    (under tensor parallelism a row's log-normaliser needs the group's statistics first).

    Args:
        hidden, weight, target, bias, with_entropy, **options: as
            :func:`linear_logprobs_and_entropy` (no ``group``).
        token_grad: :data:`TokenGrad`, called once per chunk, in order.

    Returns:
        ``(logp, entropy, grad_hidden, grad_weight, grad_bias)``: the op's outputs (detached)
        and the gradients of the loss (``grad_bias`` None without a bias).

    Example:
        >>> import torch
        >>> h, w, y = torch.randn(5, 4), torch.randn(7, 4), torch.tensor([0, 1, 2, 3, 4])
        >>> out = linear_logprobs_one_pass(h, w, y, lambda i, lp, e: (-torch.ones_like(lp), None))
        >>> hh = h.clone().requires_grad_()
        >>> (-linear_logprobs_and_entropy(hh, w, y)[0].sum()).backward()
        >>> torch.allclose(out[2], hh.grad, atol=1e-6)
        True
    """
    hidden, weight, bias = _autocast(hidden, weight, bias)
    given = Options.given(_OP, options, with_entropy=with_entropy, with_sum_pi_squared=False)
    if given.group is not None:
        raise ValueError(
            "linear_logprobs_one_pass runs in one process (group=None): under tensor "
            "parallelism differentiate linear_logprobs_and_entropy instead"
        )
    inputs, plan, (sel, s_rows, s_ids) = _engine.prepare(
        _OP, given, "hidden", hidden, target, weight=weight, bias=bias
    )
    support = None if s_rows is None or s_ids is None else (s_rows, s_ids)
    plan = plan.bound(inputs.target, inputs.keep, sel, support)
    assert inputs.weight is not None  # checked: the linear op's weight
    with _no_autocast(inputs.x), torch.no_grad():
        return _one_pass(plan, inputs.x, inputs.weight, inputs.bias, token_grad)


def _one_pass(
    plan: Plan,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    token_grad: TokenGrad,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The loop of :func:`linear_logprobs_one_pass` on a bound plan; the chunks' buffers are
    gone before the weight gradient takes the weight's dtype."""
    h2 = _rows(hidden, plan)
    n, dev, dtype = plan.rows, plan.device, plan.dtype
    logp = torch.zeros(n, dtype=dtype, device=dev)
    ent = torch.zeros(n, dtype=dtype, device=dev) if plan.with_entropy else None
    grad_h = torch.empty_like(h2, memory_format=torch.contiguous_format)
    grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
    grad_b = None if bias is None else torch.zeros(bias.shape, dtype=dtype, device=dev)
    _one_pass_chunks(plan, h2, weight, bias, token_grad, (logp, ent, grad_h, grad_w, grad_b))
    return (
        plan.expand(logp),
        None if ent is None else plan.expand(ent),
        _scattered(grad_h, hidden, plan),
        grad_w.to(weight.dtype),
        None if grad_b is None or bias is None else grad_b.to(bias.dtype),
    )


def _one_pass_chunks(
    plan: Plan,
    h2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    token_grad: TokenGrad,
    outs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None],
) -> None:
    """Each chunk of rows into ``outs`` (``logp``, ``ent``, ``grad_h``, ``grad_w``,
    ``grad_b``), the logits made once, in buffers reused from chunk to chunk."""
    logp, ent, grad_h, grad_w, grad_b = outs
    n, dev, dtype = plan.rows, plan.device, plan.dtype
    matmul = _Matmul(h2, weight, bias, plan, reuse=True)
    producer = _Kept(matmul)
    if plan.sampler is not None:
        plan = replace(plan, threshold=torch.empty((n, 1), dtype=dtype, device=dev))
    index = plan.rows_of if plan.rows_of is not None else torch.arange(n, device=dev)
    n_cols = _softmax.n_columns(plan.masked, plan.with_entropy, False)
    g_logp = torch.zeros((n, 1), dtype=dtype, device=dev)
    g_ent = torch.zeros((n, 1), dtype=dtype, device=dev)
    saved: list[torch.Tensor] = []
    # every logit kept and the entropy asked for: the statistics and the gradient share an exp
    plain = plan.with_entropy and not plan.masked and plan.sampler is None
    plain = plain and plan.keep is None and plan.support_rows is None
    ent_c: torch.Tensor | None
    for i in plan.starts:
        j = i + plan.chunk
        keep = plan.keep_rows(i, j)
        if plain:
            z, _, slope = matmul.sloped(i, j)
            idx, in_range = plan.target_index(i, j)
            lp, h, state = _softmax.plain_chunk(z, idx, in_range)
            gl, ge = token_grad(index[i:j], lp, h)
            tau = plan.head.rows(i, j).grad_scale
            ge = None if ge is None else ge[:, None]
            g = _softmax.plain_grad(state, idx, in_range, gl[:, None], ge, tau)
            g = g if slope is None else g.mul_(slope)
            logp[i:j], ent_c = lp, h
        else:
            stats = torch.empty((plan.n_rows(i, j), n_cols), dtype=dtype, device=dev)
            producer.stats(plan, i, j, keep, stats)
            lp, ent_c, kept = _softmax.merge(stats.unsqueeze(0), plan.masked, plan.with_entropy)
            gl, ge = token_grad(index[i:j], lp, ent_c)
            cols, has_h = _softmax.unpack_saved(_softmax.pack_saved(kept, plan.masked, True))
            if not saved:
                saved = [torch.empty((n, 1), dtype=dtype, device=dev) for _ in cols]
            for dst, col in zip(saved, cols, strict=True):
                dst[i:j] = col
            logp[i:j], g_logp[i:j, 0] = lp, gl
            if ge is not None:
                g_ent[i:j, 0] = ge
            tile = replace(plan, saved=tuple(saved), g_logp=g_logp, g_ent=g_ent if has_h else None)
            g = producer.grad(tile, i, j, keep)
        if ent is not None and ent_c is not None:
            ent[i:j] = ent_c
        plan.zero_masked(g, i)
        if grad_b is not None:
            grad_b += g.sum(dim=0)
        # the weight's gradient from the compute dtype's g: no half partial sums to add up
        grad_w.addmm_(g.T, h2[i:j].to(grad_w.dtype))
        torch.mm(matmul.narrowed(g, h2.dtype), weight, out=grad_h[i:j])
