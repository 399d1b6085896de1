"""Fused, token-chunked, vocabulary-parallel log-probs and entropy from logits: the op on logits.

Its producer slices the logits (or, with ``method="triton"``, :mod:`rlops.logprobs.triton`'s
kernels read them); the chunk loops, the collective and the merge are the engine's.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
from typing_extensions import Unpack  # torch's own dependency (typing.Unpack: 3.11+)

from rlops.logprobs import _engine
from rlops.logprobs._options import LogprobOptions, Options
from rlops.logprobs._plan import Plan

__all__ = ["logprobs_and_entropy"]

_OP = "logprobs_and_entropy"


class _Logits(_engine.Producer):
    """Chunks of rows of the logits ``[N, V_local]`` through the head's map, over the CPU
    thread pool."""

    parallel = True

    def __init__(self, x: torch.Tensor, plan: Plan) -> None:
        self.x, self.dtype, self.head = x, plan.dtype, plan.head
        self.rows_of = plan.rows_of

    def _rows(self, i: int, j: int) -> tuple[torch.Tensor, bool]:
        if self.rows_of is None:
            return self.x[i:j], False
        return self.x.index_select(0, self.rows_of[i:j]), True  # a fresh buffer

    def logits(self, i: int, j: int) -> tuple[torch.Tensor, bool]:
        x, own = self._rows(i, j)
        return self.head.rows(i, j).scaled(x, self.dtype, own)

    def sloped(self, i: int, j: int) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        if self.head.softcap is None:
            return (*self.logits(i, j), None)
        x, own = self._rows(i, j)
        z, slope = self.head.rows(i, j).sloped(x, self.dtype, own)
        return z, True, slope


def _producer(x: torch.Tensor, plan: Plan, kernels: bool) -> _engine.Producer:
    """The chunks' producer: the torch slices, or the Triton kernels (imported lazily)."""
    sliced = _Logits(x, plan)
    if not kernels:
        return sliced
    from rlops.logprobs.triton import TritonLogits

    return TritonLogits(x, plan, sliced)


class _FusedLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, selection, plan, kernels):
        # ``selection``: the non-differentiable per-token tensors (keep mask, the row selection,
        # the CSR support), as one tuple (each may be None)
        keep, sel, s_rows, s_ids = selection
        support = None if s_rows is None else (s_rows, s_ids)
        plan = plan.bound(target, keep, sel, support)
        x = logits.reshape(-1, plan.v_local)
        ctx.kernels = kernels
        inputs = (logits, target, keep, sel, s_rows, s_ids)
        return _engine.forward(ctx, plan, _producer(x, plan, kernels), inputs)

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_squares):
        nothing = (None,) * 5
        restored = _engine.restore(ctx, g_logp, g_ent)
        if restored is None:
            return nothing
        (logits, *_), plan = restored
        x = logits.reshape(-1, plan.v_local)
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward
            grad = _engine.grad_with_graph(plan, x, _OP)
        else:
            grad = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            _engine.logits_grad(plan, _producer(x, plan, ctx.kernels), grad)
        return grad.view(logits.shape), *nothing[1:]


class _Options(LogprobOptions, total=False):
    """The keyword arguments of :func:`logprobs_and_entropy` beside the two that choose its
    outputs (for the overloads)."""

    method: str


@overload
def logprobs_and_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    with_entropy: Literal[True] = ...,
    with_sum_pi_squared: Literal[False] = ...,
    **options: Unpack[_Options],
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def logprobs_and_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    with_entropy: Literal[False],
    with_sum_pi_squared: Literal[False] = ...,
    **options: Unpack[_Options],
) -> tuple[torch.Tensor, None]: ...
@overload
def logprobs_and_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    with_entropy: bool = ...,
    with_sum_pi_squared: Literal[False] = ...,
    **options: Unpack[_Options],
) -> tuple[torch.Tensor, torch.Tensor | None]: ...
@overload
def logprobs_and_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    with_entropy: Literal[True] = ...,
    with_sum_pi_squared: Literal[True],
    **options: Unpack[_Options],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
@overload
def logprobs_and_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    with_entropy: Literal[False],
    with_sum_pi_squared: Literal[True],
    **options: Unpack[_Options],
) -> tuple[torch.Tensor, None, torch.Tensor]: ...
@overload
def logprobs_and_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    with_entropy: bool = ...,
    with_sum_pi_squared: Literal[True],
    **options: Unpack[_Options],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]: ...
@overload
def logprobs_and_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    with_entropy: bool = ...,
    with_sum_pi_squared: bool = ...,
    **options: Unpack[_Options],
) -> _engine.Outputs: ...


def logprobs_and_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    with_entropy: bool = True,
    with_sum_pi_squared: bool = False,
    method: str = "auto",
    **options: Unpack[LogprobOptions],
) -> _engine.Outputs:
    """Log-probabilities of the targets and the entropy of the softmax, fused and chunked.

    With ``z = c·tanh(s·logits / c) / τ`` (``s = logit_scale``; ``c = final_logit_softcapping``,
    off by default: ``z = s·logits / τ``; ``τ = temperature``) and ``lse(z) = log Σ_v exp(z_v)``,
    for every token::

        log p_y = z_y − lse(z)        H = lse(z) − Σ_v softmax(z)_v · z_v

    With a support (``keep_mask``, CSR ``support_ids``, or the sampler's ``top_k`` / ``top_p``
    / ``min_p``, applied as vLLM does) the log-prob is over the support, the target always in
    it, and the entropy over all logits (over the support with ``entropy_over_support``).
    ``with_sum_pi_squared`` adds ``Σ_v π_v²`` of the log-prob's distribution ``π``, detached:
    the optimal token baseline's weight (https://arxiv.org/abs/2602.07078). The vocabulary
    may be sharded over ``group``: one all-gather of per-token statistics, no collective in
    the backward. Only ``[chunk_size, V_local]`` temporaries exist. Every option, the
    protocols, memory and threads: ``docs/design/logprobs.md``.

    Args:
        logits: ``[..., V_local]`` float16 / bfloat16 / float32 / float64.
        target: ``[...]`` integer ids in the global vocabulary ``[0, Σ_r V_local_r)``.
        with_entropy: if False, skip the entropy and return None for it.
        with_sum_pi_squared: also return ``Σ_v π_v²``, detached.
        method: ``"auto"`` (Triton for CUDA tensors when triton imports), ``"chunked"`` (torch)
            or ``"triton"`` (CUDA; CPU tensors under ``TRITON_INTERPRET=1``).
        **options: :class:`~rlops.logprobs.LogprobOptions`: ``temperature`` (a float > 0, or a
            floating tensor ``[N]`` (``[B]`` for ``[B, T]`` inputs) of per-row temperatures),
            ``logit_scale``, ``final_logit_softcapping``, ``keep_mask`` ``[..., V_local]``,
            ``support_ids`` / ``support_offsets`` (CSR), ``mask`` ``[...]`` (the rows the loss
            reads: exact 0 elsewhere), ``top_k`` / ``top_p`` / ``min_p`` (scalars or
            ``[...]``), ``entropy_over_support``, ``entropy_grad``, ``group``, ``chunk_size``,
            ``logits_dtype`` (the softmax's dtype: ``torch.float64`` widens it; the logits'
            own rounding stays).

    Returns:
        ``(logp, entropy)``, each ``[...]`` float32 (float64 for float64 logits or
        ``logits_dtype``), differentiable w.r.t. ``logits``; ``entropy`` is None with
        ``with_entropy=False``; with ``with_sum_pi_squared=True`` a third ``[...]`` output
        without gradient.

    Example:
        >>> import torch
        >>> from rlops.logprobs import logprobs_and_entropy
        >>> logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, -1.0]])
        >>> logp, ent = logprobs_and_entropy(logits, torch.tensor([1, 0]))
        >>> logp
        tensor([-1.3863, -0.2780])
        >>> ent  # log 4 for uniform logits
        tensor([1.3863, 0.8011])
        >>> # top-k = 1 keeps every logit tied with the largest, and the sampled token
        >>> logprobs_and_entropy(logits, torch.tensor([1, 1]), top_k=1)[0]
        tensor([-1.3863, -2.1269])
        >>> logprobs_and_entropy(logits, torch.tensor([1, 0]), with_sum_pi_squared=True)[2]
        tensor([0.2500, 0.5960])
        >>> # a row mask: row 1 (say, tool output) costs nothing and is exactly 0
        >>> logprobs_and_entropy(logits, torch.tensor([1, 0]), mask=torch.tensor([True, False]))
        (tensor([-1.3863,  0.0000]), tensor([1.3863, 0.0000]))
    """
    given = Options.given(
        _OP, options, with_entropy=with_entropy, with_sum_pi_squared=with_sum_pi_squared
    )
    inputs, plan, sel = _engine.prepare(_OP, given, "logits", logits, target, method=method)
    logp, ent, squares = _FusedLogprobsEntropy.apply(
        inputs.x, inputs.target, (inputs.keep, *sel), plan, inputs.method == "triton"
    )
    if with_sum_pi_squared:
        return logp, (ent if with_entropy else None), squares
    return logp, (ent if with_entropy else None)
