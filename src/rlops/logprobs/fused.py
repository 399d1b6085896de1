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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlops._checks import check_chunk_size, check_same_device, compute_dtype
from rlops._threads import for_each
from rlops.distributed.groups import group_rank_size
from rlops.logprobs import _radix, _shard, _support, _tp
from rlops.logprobs._inputs import (
    check_flags,
    check_keep_mask,
    check_logits,
    check_sampler,
    check_target,
    check_target_range,
    check_temperature,
    default_chunk,
)

__all__ = [
    "checked_sampler",
    "chunk_grad",
    "chunk_grads",
    "chunk_loop",
    "chunk_stats",
    "gather_stats",
    "grad_inputs",
    "logits_grad_with_graph",
    "logprobs_and_entropy",
    "outputs",
    "scaled_chunk",
    "support_applied",
    "vocab_layout",
]


def scaled_chunk(
    x: torch.Tensor, dtype: torch.dtype, temperature: float
) -> tuple[torch.Tensor, bool]:
    """``(x / temperature in dtype, own)``; ``own``: the result is a fresh buffer, not ``x``."""
    if x.dtype == dtype:
        return (x, False) if temperature == 1.0 else (torch.div(x, temperature), True)
    z = x.to(dtype)
    return (z if temperature == 1.0 else z.div_(temperature)), True


def gather_stats(stats: torch.Tensor, group: object, world: int) -> torch.Tensor:
    """``[N, k]`` local statistics → ``[world, N, k]``: the forward's one data collective."""
    if world == 1:
        return stats.unsqueeze(0)
    out = stats.new_empty((world * stats.shape[0], stats.shape[1]))
    # Newer torch renames all_gather_into_tensor to all_gather_single and deprecates the old name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, stats.contiguous(), group=group)
    return out.view(world, stats.shape[0], stats.shape[1])


def sampler_thresholds(
    logits_rows, n: int, chunk: int, sampler: _support.Sampler, group: object, world: int,
    dtype, device,
) -> torch.Tensor:
    """``[N, 1]`` thresholds of the sampler's support over the vocabulary sharded on ``group``,
    from this shard's scaled logits ``logits_rows(i, j)[0]`` (tokens ``i:j``).

    A scalar top-k (or min-p alone): each shard's candidates
    (:func:`_support.candidates_chunk`), one all-gather, the same merge everywhere. A per-token
    top-k, or top-p without top-k: the radix select (:func:`_radix.radix_threshold`), a fixed
    number of all-reduces, one more pass over the chunks per round."""
    if _radix.uses_radix(sampler):
        return _radix.radix_threshold(logits_rows, n, chunk, sampler, group, dtype, device)
    top_k = sampler.top_k
    cand = torch.empty((n, _support.n_candidates(top_k)), dtype=dtype, device=device)
    for i in range(0, n, chunk):
        z = logits_rows(i, i + chunk)[0]
        cand[i : i + z.shape[0]] = _support.candidates_chunk(z, top_k)
    _, top_p, min_p = sampler.rows(0, n)
    return _support.merged_threshold(gather_stats(cand, group, world), top_k, top_p, min_p)


def support_applied(
    z: torch.Tensor,
    own: bool,
    idx: torch.Tensor,
    in_range: torch.Tensor,
    threshold: torch.Tensor,
    over_support: bool,
) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
    """The sampler's support ``z ≥ threshold`` (``[C, 1]``) on one chunk of scaled logits:
    ``(z, own, keep)`` for :func:`_shard.stats_chunk` / :func:`_shard.grad_chunk`.

    Without ``over_support`` the support is the chunk's keep mask (the log-prob distribution;
    the entropy stays over all logits). With it, the logits outside the support (the target
    always inside) become ``-inf`` (probability zero), so that both the log-prob and the entropy
    are over the support, and no mask is needed.
    """
    keep = z >= threshold
    if not over_support:
        return z, own, keep
    keep.scatter_(1, idx, keep.gather(1, idx) | in_range)
    z = z.masked_fill_(~keep, float("-inf")) if own else z.masked_fill(~keep, float("-inf"))
    return z, True, None


def chunk_stats(
    logits_rows, tgt, start, v_local, chunk, keep_rows, sampler, over_support, with_entropy,
    group, world, stats, parallel=False,
):
    """The forward's chunk loop, shared by the logits and the fused linear op: fills this
    shard's statistics ``stats`` ``[N, k]`` chunk by chunk and returns the sampler's per-token
    threshold ``[N, 1]`` (None without a sampler). ``logits_rows(i, j)`` gives ``(z, own)`` for
    tokens ``i:j`` (the scaled logits and which of them this call may overwrite);
    ``keep_rows(i, j)`` a keep mask or None. ``parallel``: on CPU, spread the chunks over
    :func:`rlops._threads.for_each` (each chunk's rows are its own)."""
    n = tgt.shape[0]
    thr = None
    if sampler is not None:
        thr = torch.empty((n, 1), dtype=stats.dtype, device=stats.device)
        if world > 1:  # first passes for the global threshold
            thr = sampler_thresholds(
                logits_rows, n, chunk, sampler, group, world, stats.dtype, stats.device
            )

    def one(i: int) -> None:
        z, own = logits_rows(i, i + chunk)
        idx, in_range = _shard.target_index(tgt[i : i + chunk], start, v_local)
        kc = None if keep_rows is None else keep_rows(i, i + chunk)
        if sampler is not None:
            t = thr[i : i + chunk]
            if world == 1:
                t.copy_(_support.threshold_chunk(z, *sampler.rows(i, i + chunk)))
            z, own, kc = support_applied(z, own, idx, in_range, t, over_support)
        _shard.stats_chunk(z, own, idx, in_range, kc, with_entropy, stats[i : i + chunk])

    chunk_loop(one, range(0, n, chunk), stats.device, parallel)
    return thr


def chunk_loop(body, starts, device, parallel: bool) -> None:
    """``body(i)`` for every chunk start: over :func:`rlops._threads.for_each` when
    ``parallel`` (CPU), else in order."""
    if parallel:
        for_each(body, starts, device)
    else:
        for i in starts:
            body(i)


def vocab_layout(group, rank, world, v_local, call, target, sampler) -> int:
    """This shard's first vocabulary id: from the consistency check's gathered shard sizes when
    ``call`` is given (shards may differ in size), else ``rank * v_local``. Checks the targets
    against the whole vocabulary and caps an integer ``top_k`` at it (k >= V keeps every
    token)."""
    if call is not None:
        start, vocab = _tp.shard_layout(group, rank, world, call, target)
    else:
        start, vocab = rank * v_local, world * v_local
    check_target_range(target, vocab)
    if sampler is not None and isinstance(sampler.top_k, int):
        sampler.top_k = min(sampler.top_k, vocab)
    return start


def outputs(ctx, logp, ent, lead, entropy_grad: bool):
    """The forward's return value: ``(logp, entropy)`` shaped ``lead``; without entropy an
    empty tensor, and the entropy marked non-differentiable when it has no gradient."""
    ent_out = ent.view(lead) if ent is not None else logp.new_empty(0)
    if ent is None or not entropy_grad:
        ctx.mark_non_differentiable(ent_out)
    return logp.view(lead), ent_out


def grad_inputs(saved, g_logp, g_ent, dtype):
    """The backward's inputs: ``(saved statistics, g_logp [N, 1], g_ent [N, 1])`` in ``dtype``,
    or None when no gradient flows into either output."""
    saved, has_entropy = _shard.unpack_saved(saved)
    g_ent = g_ent if has_entropy else None
    if g_logp is None and g_ent is None:
        return None
    gl = None if g_logp is None else g_logp.reshape(-1, 1).to(dtype)
    ge = None if g_ent is None else g_ent.reshape(-1, 1).to(dtype)
    return saved, gl, ge


def chunk_grads(
    logits_rows, tgt, start, v_local, chunk, keep_rows, thr, over_support, saved, gl, ge,
    temperature,
):
    """The backward's chunk loop in order (the fused linear op's, whose weight gradient sums
    over the chunks): yields ``(i, j, g)``, :func:`chunk_grad` of tokens ``i:j``."""
    args = (logits_rows, tgt, start, v_local, keep_rows, thr, over_support, saved, gl, ge)
    for i in range(0, tgt.shape[0], chunk):
        yield i, i + chunk, chunk_grad(i, i + chunk, *args, 1.0 / temperature)


def chunk_grad(
    i, j, logits_rows, tgt, start, v_local, keep_rows, thr, over_support, saved, gl, ge,
    inv_tau, out=None,
):
    """The backward's step for one chunk, shared by the logits and the fused linear op: the
    gradient with respect to the scaled logits of tokens ``i:j`` (``[C, V_local]``),
    recomputing the softmax from the saved statistics; written into ``out`` (those rows' own
    ``[C, V_local]`` buffer) when it is given and has the compute dtype."""
    z, own = logits_rows(i, j)
    idx, in_range = _shard.target_index(tgt[i:j], start, v_local)
    kc = None if keep_rows is None else keep_rows(i, j)
    if thr is not None:
        z, own, kc = support_applied(z, own, idx, in_range, thr[i:j], over_support)
    return _shard.grad_chunk(
        z,
        own,
        idx,
        in_range,
        kc,
        [t[i:j] for t in saved],
        None if gl is None else gl[i:j],
        None if ge is None else ge[i:j],
        inv_tau,
        **({} if out is None else {"out": out}),
    )


def logits_grad_with_graph(
    x: torch.Tensor,
    target: torch.Tensor,
    keep: torch.Tensor | None,
    temperature: float,
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    world: int,
    op: str,
    threshold: torch.Tensor | None = None,
    over_support: bool = False,
) -> torch.Tensor:
    """Gradient w.r.t. the logits ``x`` ``[N, V]`` as a differentiable function of ``x`` and of
    the upstream gradients ``[N, 1]``: the backward when autograd records it (double backward).

    One process only: with a sharded vocabulary the second derivatives couple the shards (and
    the replicated outputs' gradients would be partial per rank), so it raises RuntimeError.
    """
    if world > 1:
        raise RuntimeError(
            f"double backward (create_graph=True) through {op} is not supported with a "
            f"tensor-parallel group of {world} ranks; use the unfused reference "
            "(rlops.logprobs.reference) on the full vocabulary for higher derivatives"
        )
    z = x.to(compute_dtype(x.dtype)) / temperature
    idx = target.reshape(-1, 1)
    if threshold is not None:  # the sampler's support, piecewise constant: no graph through it
        keep = z.detach() >= threshold.reshape(-1, 1)
        if over_support:
            keep = keep.scatter(1, idx, True)
            z = z.masked_fill(~keep, float("-inf"))
            keep = None
    grad = _shard.grad_differentiable(z, idx, keep, g_logp, g_ent, 1.0 / temperature)
    return grad.to(x.dtype)


class _FusedLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits,
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
        v_local = logits.shape[-1]
        x = logits.reshape(-1, v_local)
        tgt = target.reshape(-1)
        keep2 = None if keep is None else keep.reshape(-1, v_local)
        n = x.shape[0]
        dtype = compute_dtype(logits.dtype)
        chunk = chunk or default_chunk(n, v_local, logits.device)
        masked = keep is not None or (sampler is not None and not over_support)
        stats = torch.empty(
            (n, _shard.n_columns(masked, with_entropy)), dtype=dtype, device=logits.device
        )
        keep_rows = None if keep2 is None else (lambda i, j: keep2[i:j])
        thr = chunk_stats(
            lambda i, j: scaled_chunk(x[i:j], dtype, temperature),
            tgt, start, v_local, chunk, keep_rows, sampler, over_support, with_entropy,
            group, world, stats, parallel=True,
        )  # fmt: skip
        logp, ent, saved = _shard.merge(gather_stats(stats, group, world), masked, with_entropy)
        saved = _shard.pack_saved(saved, masked, entropy_grad)
        ctx.set_materialize_grads(False)
        ctx.meta = (temperature, start, chunk, world, over_support)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(logits, target, keep, thr, *saved)
        return outputs(ctx, logp, ent, logits.shape[:-1], entropy_grad)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        temperature, start, chunk, world, over_support = ctx.meta
        logits, target, keep, thr, *saved = ctx.saved_tensors
        nones = (None,) * 10
        dtype = compute_dtype(logits.dtype)
        inputs = grad_inputs(saved, g_logp, g_ent, dtype)
        if inputs is None:
            return (None, *nones)
        saved, gl, ge = inputs
        v_local = logits.shape[-1]
        x = logits.reshape(-1, v_local)
        tgt = target.reshape(-1)
        keep2 = None if keep is None else keep.reshape(-1, v_local)
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward
            grad = logits_grad_with_graph(
                x, tgt, keep2, temperature, gl, ge, world, "logprobs_and_entropy",
                thr, over_support,
            )
            return (grad.view(logits.shape), *nones)
        grad = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        args = (
            lambda i, j: scaled_chunk(x[i:j], dtype, temperature),
            tgt, start, v_local,
            None if keep2 is None else (lambda i, j: keep2[i:j]),
            thr, over_support, saved, gl, ge, 1.0 / temperature,
        )  # fmt: skip

        def one(i: int) -> None:
            g = chunk_grad(i, i + chunk, *args, grad[i : i + chunk])
            if g.dtype != grad.dtype:  # half-precision logits: the chunk was computed in float32
                grad[i : i + chunk] = g

        chunk_loop(one, range(0, x.shape[0], chunk), x.device, True)
        return (grad.view(logits.shape), *nones)


def logprobs_and_entropy(
    logits: torch.Tensor,
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
    r"""Log-probabilities of the targets and the entropy of the softmax, fused and chunked.

    With ``z = logits / temperature`` over the full vocabulary, for every token:

    .. math::

        \log p_y = z_y - \operatorname{lse}(z), \qquad
        H = \operatorname{lse}(z) - \sum_v \operatorname{softmax}(z)_v\, z_v .

    With ``keep_mask`` (top-p / top-k replay), the log-prob is taken over the kept logits only
    (the target is always kept), while the entropy uses all logits.

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

    Per-token ``top_k`` / ``top_p`` / ``min_p`` must be equal on every rank (not checked).

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

    Consistency check (tensor parallel): before the statistics, one all-gather of 15 numbers
    per rank compares the tokens, the target ids (a checksum), the dtype, the flags, whether a
    keep mask is given, the temperature and the scalar sampler parameters, and collects the
    shard sizes (which may differ).
    Every rank then raises the same ``ValueError`` naming what disagrees, instead of returning
    wrong values or aborting in the collective; a rank whose own arguments are invalid raises
    its error and the others a ``ValueError`` naming it. Reading the 15 numbers is a host
    synchronisation; ``RLOPS_TP_CHECK=0`` (on every rank) skips the check, leaving the one
    collective, and then requires shards of equal size.

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
    rebuilds the support (``z ≥ t``) without sorting again.
    Logits that cannot be viewed as ``[N, V_local]`` (e.g. a slice ``x[:, :-1]``) are copied.

    Args:
        logits: ``[..., V_local]`` float16 / bfloat16 / float32 / float64.
        target: ``[...]`` integer ids in the global vocabulary ``[0, Σ_r V_local_r)``.
        temperature: ``> 0``; divides the logits before everything.
        keep_mask: ``[..., V_local]`` bool, or None (keep all). Not with the sampler filters.
        top_k: int ``≥ 1`` or an integer tensor ``[...]`` (per token); ``≥ V`` keeps all.
        top_p: float in ``(0, 1]`` or a floating tensor ``[...]``; 1 keeps all.
        min_p: float in ``[0, 1]`` or a floating tensor ``[...]``; 0 keeps all.
        entropy_over_support: take the entropy over the sampler's support (requires one of
            ``top_k``, ``top_p``, ``min_p``).
        with_entropy: if False, skip all entropy work and return ``None`` for it.
        entropy_grad: if False, the entropy is returned detached and nothing is saved for its
            backward (use it when the entropy is only logged).
        group: the tensor-parallel process group over which the vocabulary is sharded, or None.
        chunk_size: tokens per chunk (``>= 1``); None picks a bound of a few MiB per
            ``[chunk, V_local]`` float32 buffer on CPU and 128 MiB on accelerators.

    Returns:
        ``(logp, entropy)``, each ``[...]``, float32 (float64 for float64 logits);
        ``entropy`` is None when ``with_entropy=False``. Differentiable w.r.t. ``logits``.

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
    """
    rank, world = group_rank_size(group)
    checked = world > 1 and _tp.check_enabled()
    try:
        logits, target, keep_mask, temperature = _checked(
            logits, target, temperature, keep_mask, with_entropy, entropy_grad, chunk_size
        )
        sampler = checked_sampler(
            "logits", logits, top_k, top_p, min_p, keep_mask, entropy_over_support
        )
    except (TypeError, ValueError) as exc:
        if checked:  # the other ranks are about to exchange headers: join them, then raise
            _tp.fail_together(group, world, exc, getattr(logits, "device", None))
        raise
    v_local = logits.shape[-1]
    if checked:
        call = _tp.Call(
            op="logprobs_and_entropy",
            v_local=v_local,
            tokens=target.numel(),
            hidden=0,
            dtype=logits.dtype,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            masked=keep_mask is not None,
            temperature=temperature,
            sampler=_tp.sampler_fields(top_k, top_p, min_p, entropy_over_support),
        )
    else:
        call = None
    start = vocab_layout(group, rank, world, v_local, call, target, sampler)
    args = (with_entropy, entropy_grad, group, chunk_size, start, sampler, entropy_over_support)
    logp, ent = _FusedLogprobsEntropy.apply(logits, target, keep_mask, temperature, *args)
    return logp, (ent if with_entropy else None)


def _checked(logits, target, temperature, keep_mask, with_entropy, entropy_grad, chunk_size):
    """This rank's own argument checks: ``(logits, target as int64, keep_mask, temperature)``."""
    logits = check_logits("logits", logits)
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension, got [..., 0]")
    temperature = check_temperature(temperature)
    check_flags(with_entropy=with_entropy, entropy_grad=entropy_grad)
    check_chunk_size(chunk_size)
    target = check_target(
        target, logits.shape[:-1], "[...] like logits[..., 0] " + str(list(logits.shape[:-1]))
    )
    keep_mask = check_keep_mask(keep_mask, logits.shape)
    check_same_device("logits", logits, target=target, keep_mask=keep_mask)
    return logits, target, keep_mask, temperature


def checked_sampler(name, ref, top_k, top_p, min_p, keep_mask, entropy_over_support):
    """The sampler filters as a :class:`_support.Sampler`, or None when none is given.

    ``ref``: the tensor ``[..., X]`` whose leading dims are the tokens (named ``name``)."""
    check_flags(entropy_over_support=entropy_over_support)
    params = check_sampler(top_k, top_p, min_p, ref, name)
    if params is None:
        if entropy_over_support:
            raise ValueError("entropy_over_support=True needs top_k, top_p or min_p")
        return None
    if keep_mask is not None:
        raise ValueError(
            "keep_mask and top_k / top_p / min_p are exclusive: give the sampler's support "
            "either as a mask or as its parameters"
        )
    named = zip(("top_k", "top_p", "min_p"), params, strict=True)
    check_same_device(name, ref, **{n: p for n, p in named if p is not None})
    return _support.Sampler(*params)
