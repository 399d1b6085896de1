"""Fused, token-chunked, vocabulary-parallel log-probs and entropy from logits.

The forward reduces each ``[chunk, V_local]`` slice of logits to a few numbers per token
(see :mod:`rlops.logprobs._shard`), gathers them across the vocabulary shards in one collective
(preceded by a small consistency check, :mod:`rlops.logprobs._tp`) and merges them; the backward
recomputes the softmax chunk by chunk from the saved per-token statistics and needs no
collective. With the sampler's filters (:mod:`rlops.logprobs._support`) each chunk's support is
``z ≥ t`` for a per-token threshold ``t``, computed in the chunk loop (one process) or, across
vocabulary shards, before the loop: merged from each shard's candidates in one more all-gather
(a scalar top-k, min-p), or found by a radix select in a fixed number of all-reduces (top-p
without top-k, a per-token top-k: :mod:`rlops.logprobs._radix`).

The chunk loops are the engine's (:mod:`rlops.logprobs._engine`); this op's producer slices
the logits, and its backward writes the gradient of each chunk of rows into the logits'. With
``method="triton"`` the producer is :class:`rlops.logprobs.triton.TritonLogits`, whose kernels
compute a chunk's statistics and gradient in one pass over vocabulary tiles
(:mod:`rlops.logprobs._method` chooses).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal, overload

import torch
from typing_extensions import Unpack  # torch's own dependency (typing.Unpack: 3.11+)

from rlops._checks import check_chunk_size, check_same_device
from rlops.logprobs import _engine, _method
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

__all__ = ["logprobs_and_entropy"]

_OP = "logprobs_and_entropy"


class _Logits(_engine.Producer):
    """Chunks of rows of the logits ``[N, V_local]``, through the head's map (scale, softcap,
    temperature: :class:`rlops.logprobs._head.Head`); over the CPU thread pool."""

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
        return self.head.scaled(x, self.dtype, own)

    def sloped(self, i: int, j: int) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        if self.head.softcap is None:
            return (*self.logits(i, j), None)
        x, own = self._rows(i, j)
        z, slope = self.head.sloped(x, self.dtype, own)
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
        # ``selection``: the non-differentiable per-token tensors (keep mask, the sampler's
        # per-token options, the CSR support), as one tuple (each may be None)
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

    With ``z = logits / τ`` (``τ = temperature``) over the full vocabulary and
    ``lse(z) = log Σ_v exp(z_v)``, for every token::

        log p_y = z_y − lse(z)        H = lse(z) − Σ_v softmax(z)_v · z_v

    With ``keep_mask`` (top-p / top-k replay), the log-prob is taken over the kept logits only
    (the target is always kept), while the entropy uses all logits.

    Output heads that scale or cap their logits (Cohere, Granite, Gemma-2/3), in Hugging Face's
    order: with ``logit_scale = s`` and ``final_logit_softcapping = c``, before the
    temperature::

        z = c·tanh(s·logits / c) / τ

    (``z = s·logits/τ`` without ``c``), in the compute dtype, elementwise (each shard applies
    it to its own logits). The gradient goes through the chain,
    ``∂z/∂logits = s·(1 − tanh²(s·logits/c))/τ``; with a softcap the backward holds one more
    ``[chunk_size, V_local]`` temporary (the slope). The defaults (``s = 1``, no cap) compute
    nothing more: the bits of the op without them.

    With ``with_sum_pi_squared=True`` a third output is ``Σ_v π_v²`` per token, where ``π`` is
    the distribution whose log-prob is returned: ``softmax(z)`` over the full vocabulary, or,
    with ``keep_mask`` or the sampler's filters, the softmax of ``z`` renormalised over the
    support (target included), so ``log π_y`` is ``logp`` — whatever ``entropy_over_support``
    says about the entropy. Then ``‖∂logp/∂z‖² = 1 − 2π_y + Σ_v π_v²`` (times ``1/τ²`` for the
    logits), the squared norm of the log-prob's gradient that the optimal token baseline
    (OTB, https://arxiv.org/abs/2602.07078) sums into its weights. It is
    computed in the same chunk loop, relative to the same maxima: each shard's own
    ``ρ_r = Σ (e / Σ e)²`` with ``e = exp(z − m_r)``, merged in float64 as ``Σ_r q_r² ρ_r``
    with ``q_r`` the shard's probability mass (the Triton kernels accumulate ``Σ e`` and
    ``Σ e²`` in float64 and form ``ρ_r`` from them); under a ``group`` it
    travels in the same single collective (one more column of ``[N, k]``). It is returned
    detached: a constant weight, without gradient.

    Sampler support: ``top_k``, ``top_p`` and ``min_p`` rebuild the sampler's support from
    ``z`` chunk by chunk inside the loop (never an ``[N, V]`` mask; a chunk's sort is the extra
    temporary), as vLLM applies them after the temperature: min-p (``p_v ≥ min_p · max p``),
    then top-k and top-p over what min-p kept, top-p on the distribution renormalised over the
    top-k. Each keeps the logits at or above a threshold: top-k keeps every logit ``≥`` the
    k-th largest value (ties with it all kept, as vLLM); top-p sorts descending and keeps the
    smallest prefix whose mass reaches ``p``, the crossing token included, and every logit
    tied with that token (vLLM keeps a sort-order-dependent subset of such ties). The support
    is computed in float32 (float64 for float64 logits), like the engines' float32 sampler. The
    target (the sampled token) is always kept, even outside the nominal support. The log-prob
    is renormalised over the support; the entropy is over all logits, or over the support
    (target included) with ``entropy_over_support=True``. The support is a piecewise-constant
    function of the logits: the gradient is that of the masked softmax, with nothing through
    the selection. Under a tensor-parallel ``group`` the threshold is global, found before the
    statistics after more passes over the chunks, every rank deriving the same value:

    - an int ``top_k`` (with or without ``top_p`` / ``min_p``), or ``min_p`` alone: each shard
      sends its ``top_k`` largest values per token, its k-th value and how many of its tokens
      tie with it but were left out (``[N, top_k + 2]``, ``top_k`` capped at the vocabulary
      size; the max without top-k): one more all-gather, after one pass;
    - ``top_p`` without ``top_k``, or a per-token ``top_k`` tensor (with or without ``top_p`` /
      ``min_p``): a radix select of the threshold on the logits' order-preserving integer keys,
      one byte per round (``R`` = 4 rounds in float32, 8 in float64), each round one pass over
      the chunks (int64 keys: ``[chunk_size, V_local]`` temporaries) and one all-reduce of
      per-token histograms (``[256]`` counts, ``[2, 256]`` with the masses for top-p), after
      one all-reduce of the per-token max ``[N]`` (top-p, min-p). More collectives, but a fixed
      number and no host read: ``1 + R`` for top-p (with or without min-p), ``R`` for a
      per-token top-k alone (``1 + R`` with min-p), ``1 + 2R`` for a per-token top-k with
      top-p; with the check and the statistics, top-p alone in float32 makes 7 collectives per
      forward (11 in float64).

    Per-token ``top_k`` / ``top_p`` / ``min_p`` must be equal on every rank (compared by a
    checksum of their bits in the consistency check below).

    The vocabulary may be sharded over ``group`` (tensor parallel): rank ``r`` holds the
    logits of the ids that follow the shards of ranks ``< r`` (``[r·V_local, (r+1)·V_local)``
    when all shards have one size). Each shard reduces its slice to a few numbers per token
    (max ``m_r``, ``s_r = Σ exp(z − m_r)``, its own entropy ``h_r``, the target logit if it
    holds the target); the statistics travel in exactly one collective (an all-gather of
    ``[N, k]``, ``k ≤ 6``; the sampler's threshold adds its own, above) and the backward
    needs none (``∂logp/∂z = onehot − p``,
    ``∂H/∂z = −p·(log p + H)``). Every rank returns the full results and the gradient of its
    own shard. ``group=None`` means one process holding the whole vocabulary (no collective,
    even if ``torch.distributed`` is initialised). Every rank of the group must call it.

    Consistency check (tensor parallel): before the statistics, one all-gather of 64 numbers
    per rank (:mod:`rlops.distributed.collectives`) compares the tokens, the target ids (a
    checksum), the dtype, the flags, whether a keep mask is given, the temperature, the scalar
    sampler parameters and a checksum of each per-token one, and collects the shard sizes
    (which may differ).
    Every rank then raises the same ``ValueError`` naming what disagrees, instead of returning
    wrong values or aborting in the collective; a rank whose own arguments are invalid raises
    its error and the others a ``ValueError`` naming it. Reading the exchanged numbers is a
    host synchronisation; ``RLOPS_TP_CHECK=0`` or ``RLOPS_GROUP_CHECK=0`` (on every rank) skips
    the check, leaving the one collective, and then requires shards of equal size.

    Double backward (``create_graph=True``) is supported in one process: the backward is then
    recomputed with differentiable operations on the whole ``[N, V]`` (memory as the unfused
    reference). With a tensor-parallel group of more than one rank it raises RuntimeError.

    Numerics: computed in float32 (float64 for float64 logits) relative to the row max; the
    entropy is merged as ``H = Σ_r q_r·(h_r + (M − m_r) + (log S − log s_r))`` with
    ``q_r`` the mass of shard ``r``, a sum of non-negative terms, so it does not cancel when
    the logits are large. A ``-inf`` logit is a probability of zero (finite entropy and
    gradients).

    Threads (CPU): the chunks, forward and backward, are spread over torch's threads, each
    running whole chunks single-threaded (:mod:`rlops._threads`; the same bits as one thread),
    so a busy core slows one worker instead of every operation's join.

    Memory: float32 temporaries are ``[chunk_size, V_local]`` (per thread on CPU); saved for
    the backward are the inputs and 2–5 numbers per token; the backward recomputes the
    softmax chunk by chunk. With ``top_k`` / ``top_p`` / ``min_p`` the forward also sorts each
    chunk (a few more ``[chunk_size, V_local]`` temporaries; top-k alone uses ``topk``), and
    saves one more number per token, the support's threshold, from which the backward
    rebuilds the support (``z ≥ t``) without sorting again. ``with_sum_pi_squared`` adds no
    temporary (a division and a dot product on the chunk's ``exp(z − m)``) and saves nothing
    more.
    Logits that cannot be viewed as ``[N, V_local]`` (e.g. a slice ``x[:, :-1]``) are copied.

    Args:
        logits: ``[..., V_local]`` float16 / bfloat16 / float32 / float64.
        target: ``[...]`` integer ids in the global vocabulary ``[0, Σ_r V_local_r)``.
        with_entropy: if False, skip all entropy work and return ``None`` for it.
        method: ``"auto"`` (default), ``"chunked"`` or ``"triton"``. ``"chunked"``: torch
            operations on each chunk. ``"triton"``: Triton kernels (the ``gpu`` extra) compute
            each chunk's statistics and gradient in one pass over vocabulary tiles, on CUDA
            tensors, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``);
            the collectives, the merge, the sampler's threshold search and double backward
            stay the torch ones. ``"auto"``: Triton for CUDA tensors when triton can be
            imported (chunked while ``torch.compile`` traces), else chunked. The kernels
            apply the temperature only: with ``logit_scale ≠ 1`` or a softcap, ``"triton"``
            and ``"auto"`` run the chunked method (the kernels' check of the arguments still
            applies). A kernel that
            fails to build on the device warns once (``RuntimeWarning``) and the chunked
            method runs for the rest of the process.
        with_sum_pi_squared: also return ``Σ_v π_v²`` (above), detached.

        **options: the keyword options of :class:`~rlops.logprobs.LogprobOptions`, below.

    Other Parameters:
        temperature: ``> 0``; divides the logits, after the scale and the softcap.
        logit_scale: finite ``> 0``, multiplies the logits first (Cohere's ``logit_scale``;
            Granite's ``logits_scaling`` divides them: pass ``1 / logits_scaling``).
        final_logit_softcapping: None (off), or a finite ``c > 0``: the logits become
            ``c·tanh(logits / c)`` after the scale (Gemma-2/3's ``final_logit_softcapping``).
        keep_mask: ``[..., V_local]`` bool, or None (keep all). Not with the sampler filters.
        support_ids: the kept sets as CSR (the engine's form, e.g. vLLM's): int32 / int64
            ``[nnz]`` global vocabulary ids, with ``support_offsets`` int32 / int64
            ``[N + 1]`` (non-decreasing, from 0 to ``nnz``; ``N = target.numel()``): row
            ``i`` keeps ``support_ids[offsets[i]:offsets[i+1]]``. Exactly ``keep_mask`` with
            those entries True (the target always kept; an empty set keeps only the target;
            a repeated id counts once), without an ``[N, V]`` mask: each chunk's keep mask
            ``[chunk, V_local]`` is set from its ids (on CPU the chunk's entries are found
            from the offsets; elsewhere, with no host read, every entry is tested per
            chunk). Under a ``group`` every rank gets the same global ids and uses those of
            its shard. Not with ``keep_mask`` or the sampler filters.
        support_offsets: see ``support_ids``.
        mask: ``[...]`` bool like ``target``, or None: the rows the loss reads (the response
            or action tokens). Where False the log-prob, the entropy and ``Σ π²`` are exactly
            0 and carry no gradient (zero rows in ``logits.grad``), whatever those logits
            hold. Where values are read (CPU tensors, not under ``torch.compile``) the valid
            rows are found (their number read on the host) and only they are computed: time
            follows the number of valid rows. Elsewhere (accelerators, ``torch.compile``)
            the host never reads it: every chunk is computed, with the masked rows zeroed
            (with ``method="triton"`` their programs skip the vocabulary work). Under a
            ``group`` the mask must be equal on every rank (part of the consistency check);
            the statistics still travel in one collective.
        top_k: int ``≥ 1`` or an integer tensor ``[...]`` (per token); ``≥ V`` keeps all.
        top_p: float in ``(0, 1]`` or a floating tensor ``[...]``; 1 keeps all.
        min_p: float in ``[0, 1]`` or a floating tensor ``[...]``; 0 keeps all.
        entropy_over_support: take the entropy over the sampler's support (requires one of
            ``top_k``, ``top_p``, ``min_p``).
        entropy_grad: if False, the entropy is returned detached and nothing is saved for its
            backward (use it when the entropy is only logged).
        group: the tensor-parallel process group over which the vocabulary is sharded, or None.
        chunk_size: tokens per chunk (``>= 1``); None picks a bound of a few MiB per
            ``[chunk, V_local]`` float32 buffer on CPU and 128 MiB on accelerators (with
            ``method="triton"`` and no sampler filter, one chunk of all tokens: the kernels
            hold no such buffer).
    Returns:
        ``(logp, entropy)``, each ``[...]``, float32 (float64 for float64 logits);
        ``entropy`` is None when ``with_entropy=False``. Differentiable w.r.t. ``logits``.
        With ``with_sum_pi_squared=True``: ``(logp, entropy, sum_pi_squared)``, the last
        ``[...]`` in the same dtype and without gradient.

    Example:
        >>> import torch
        >>> from rlops.logprobs import logprobs_and_entropy
        >>> logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, -1.0]])
        >>> logp, ent = logprobs_and_entropy(logits, torch.tensor([1, 0]))
        >>> logp
        tensor([-1.3863, -0.2780])
        >>> ent  # log 4 for uniform logits
        tensor([1.3863, 0.8011])
        >>> # top-k = 1 keeps every logit tied with the largest (all four in row 0), and
        >>> # the sampled token even outside it (row 1: the support is {0, 1})
        >>> logprobs_and_entropy(logits, torch.tensor([1, 1]), top_k=1)[0]
        tensor([-1.3863, -2.1269])
        >>> # Σ π² is 1/4 for four equal logits
        >>> logprobs_and_entropy(logits, torch.tensor([1, 0]), with_sum_pi_squared=True)[2]
        tensor([0.2500, 0.5960])
        >>> # a row mask: row 1 (say, tool output) costs nothing and is exactly 0
        >>> logprobs_and_entropy(logits, torch.tensor([1, 0]), mask=torch.tensor([True, False]))
        (tensor([-1.3863,  0.0000]), tensor([1.3863, 0.0000]))
        >>> # a softcap of 1 (Gemma's is 30): logits (0, 100) become (0, tanh 100 = 1)
        >>> logprobs_and_entropy(torch.tensor([[0.0, 100.0]]), torch.tensor([0]),
        ...                      final_logit_softcapping=1.0)[0]
        tensor([-1.3133])
        >>> # CSR kept sets: row 0 keeps {2} (and its target 1), row 1 keeps {1, 3} and 0
        >>> ids, offsets = torch.tensor([2, 1, 3]), torch.tensor([0, 1, 3])
        >>> logprobs_and_entropy(logits, torch.tensor([1, 0]), support_ids=ids,
        ...                      support_offsets=offsets)[0]
        tensor([-0.6931, -0.1698])
    """
    given = _engine.Options.given(
        "logprobs_and_entropy",
        options,
        with_entropy=with_entropy,
        with_sum_pi_squared=with_sum_pi_squared,
    )
    chosen: list[str] = []

    def check() -> _engine.Checked:
        inputs = _checked(logits, target, given)
        resolved = _method.resolve(method, inputs.x)  # a rank's bad method joins the TP check
        if resolved == "triton" and (inputs.logit_scale != 1.0 or inputs.softcap is not None):
            resolved = "chunked"  # the kernels have no scale or softcap: the torch maths
        chosen.append(resolved)
        # the kernels' programs of masked rows return at once: no compaction for them
        return replace(inputs, compact=chosen[0] != "triton")

    inputs, plan, sel = _engine.prepare(_OP, logits, given, check)
    kernels = chosen[0] == "triton"
    if kernels and given.chunk_size is None and plan.sampler is None and plan.support_rows is None:
        plan = replace(plan, chunk=max(plan.rows, 1))  # the kernels need no [chunk, V] buffer
    logp, ent, squares = _FusedLogprobsEntropy.apply(
        inputs.x, inputs.target, (inputs.keep, *sel), plan, kernels
    )
    if with_sum_pi_squared:
        return logp, (ent if with_entropy else None), squares
    return logp, (ent if with_entropy else None)


def _checked(logits: object, target: object, options: _engine.Options) -> _engine.Checked:
    """This rank's own argument checks (the sampler's are the engine's)."""
    logits = check_logits("logits", logits)
    v_local = logits.shape[-1]
    if v_local == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension, got [..., 0]")
    temperature = check_temperature(options.temperature)
    logit_scale = check_logit_scale(options.logit_scale)
    softcap = check_softcap(options.final_logit_softcapping)
    check_flags(
        with_entropy=options.with_entropy,
        entropy_grad=options.entropy_grad,
        with_sum_pi_squared=options.with_sum_pi_squared,
    )
    check_chunk_size(options.chunk_size)
    lead = logits.shape[:-1]
    target = check_target(target, lead, "logits")
    keep_mask = check_keep_mask(options.keep_mask, logits.shape)
    mask = check_row_mask(options.mask, lead, "logits[..., 0]")
    support = check_support(options.support_ids, options.support_offsets, target.numel())
    s_ids, s_offsets = (None, None) if support is None else support
    check_same_device(
        "logits", logits, target=target, keep_mask=keep_mask, mask=mask, support_ids=s_ids,
        support_offsets=s_offsets,
    )  # fmt: skip
    n = target.numel()
    chunk = options.chunk_size
    return _engine.Checked(
        name="logits",
        x=logits,
        target=target,
        keep=keep_mask,
        temperature=temperature,
        logit_scale=logit_scale,
        softcap=softcap,
        v_local=v_local,
        chunk=chunk if chunk is not None else default_chunk(n, v_local, logits.device),
        mask=mask,
        support=support,
    )
