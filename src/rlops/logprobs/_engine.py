"""The chunk engine under the log-prob ops: one preamble, the chunk loops, a producer interface.

Both public ops run the same engine on a :class:`~rlops.logprobs._plan.Plan` and differ only in
their :class:`Producer`, the object that makes a chunk of this shard's scaled logits (a slice of
the logits, or ``hidden @ weightᵀ``), and in what they do with the gradient of the logits
(write it, or multiply it into the hidden and weight gradients).

- :func:`prepare`: the preamble. This rank's checks (a rank that fails joins the
  tensor-parallel consistency check before raising, :func:`_tp.fail_together`), the check
  itself (:func:`_tp.shard_layout`: the shard's first id, the whole vocabulary), and the plan.
- :func:`forward`: the statistics chunk by chunk (:meth:`Producer.stats`; the sampler's global
  threshold first under tensor parallelism, :func:`sampler_thresholds`), the one collective
  (:func:`gather_stats`), the merge (:func:`_shard.merge`) and what the backward keeps.
- :func:`restore` → the backward's plan; :meth:`Producer.grad` per chunk of rows (any rows: the
  fused linear op asks for ``[tokens, vocabulary]`` tiles through :meth:`Plan.tile`);
  :func:`logits_grad` writes it into the logits' gradient; :func:`grad_with_graph` is the
  differentiable backward (double backward).

A producer gives :meth:`Producer.logits`. The default :meth:`Producer.stats` and
:meth:`Producer.grad` run the torch maths of :mod:`rlops.logprobs._shard` on those logits; a
producer that computes a chunk's statistics or its gradient by other means (a kernel reading
the logits in vocabulary tiles) overrides them and keeps :meth:`Producer.logits` for the
passes of the sampler's threshold under tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.distributed as dist

from rlops._checks import check_same_device, compute_dtype, values_checked
from rlops._threads import for_each
from rlops._types import Group
from rlops.distributed.groups import group_rank_size
from rlops.logprobs import _radix, _shard, _support, _tp
from rlops.logprobs._checks import (
    check_flags,
    check_sampler,
    check_support_range,
    check_target_range,
)
from rlops.logprobs._options import LogprobOptions
from rlops.logprobs._plan import Plan
from rlops.logprobs._support import Sampler

__all__ = [
    "Checked",
    "Options",
    "Outputs",
    "Producer",
    "Selection",
    "checked_sampler",
    "forward",
    "gather_stats",
    "grad_with_graph",
    "logits_grad",
    "prepare",
    "restore",
    "sampler_thresholds",
    "support_applied",
    "vocab_layout",
]


# --------------------------------------------------------------------------- the preamble
# What a public op returns: (logp, entropy) or (logp, entropy, sum_pi_squared).
Outputs = (
    tuple[torch.Tensor, torch.Tensor | None]
    | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]
)


@dataclass(frozen=True, kw_only=True)
class Options:
    """The keyword arguments of a public log-prob op, as the caller gave them (unchecked: the
    types are the documented ones, which the checks enforce)."""

    temperature: float = 1.0
    logit_scale: float = 1.0
    final_logit_softcapping: float | None = None
    keep_mask: torch.Tensor | None = None
    support_ids: torch.Tensor | None = None
    support_offsets: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    top_k: int | torch.Tensor | None = None
    top_p: float | torch.Tensor | None = None
    min_p: float | torch.Tensor | None = None
    entropy_over_support: bool = False
    with_entropy: bool = True
    entropy_grad: bool = True
    with_sum_pi_squared: bool = False
    group: Group = None
    chunk_size: int | None = None

    @classmethod
    def given(
        cls, op: str, options: LogprobOptions, *, with_entropy: bool, with_sum_pi_squared: bool
    ) -> Options:
        """The options of a call of ``op`` (its ``**options`` and the two output switches);
        a keyword that is none of :class:`~rlops.logprobs._options.LogprobOptions` is a
        ``TypeError`` naming it."""
        unknown = sorted(set(options) - set(LogprobOptions.__annotations__))
        if unknown:
            raise TypeError(
                f"{op}() got unexpected keyword argument(s) {unknown}; its options are "
                f"{sorted(LogprobOptions.__annotations__)}"
            )
        return cls(**options, with_entropy=with_entropy, with_sum_pi_squared=with_sum_pi_squared)


@dataclass(frozen=True, kw_only=True)
class Checked:
    """One op's inputs after this rank's own checks.

    ``x``: the tensor whose leading dims are the tokens (``logits`` or ``hidden``, named
    ``name``); ``weight``, ``bias``: the output layer's (linear op) or None; ``target`` as
    int64;
    ``chunk``: tokens per chunk (the op's default when ``chunk_size`` is None); ``hidden``: the
    hidden size (0 for logits), compared across ranks; ``mask``: the row mask ``[...]`` or None;
    ``support``: the CSR ``(support_ids, support_offsets)`` or None; ``logit_scale``,
    ``softcap``: the head's map (:class:`rlops.logprobs._head.Head`); ``compact``: whether the
    valid rows of ``mask`` may be compacted where the host reads values (not for the Triton
    kernels, whose programs of masked rows return at once).
    """

    name: str
    x: torch.Tensor
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    target: torch.Tensor
    keep: torch.Tensor | None
    temperature: float
    v_local: int
    chunk: int | None
    hidden: int = 0
    mask: torch.Tensor | None = None
    support: tuple[torch.Tensor, torch.Tensor] | None = None
    logit_scale: float = 1.0
    softcap: float | None = None
    compact: bool = True


# The tensors a plan binds beside the target and the keep mask: the row selection (int64 rows
# or a bool mask) and the CSR support's (rows, ids); passed to the autograd functions and saved.
Selection = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def prepare(
    op: str, first: object, options: Options, check: Callable[[], Checked]
) -> tuple[Checked, Plan, Selection]:
    """The preamble of the op named ``op``: ``(checked inputs, plan, selection)``.

    ``check()`` runs the op's own checks; ``first``: its first argument as given (its device
    carries the consistency check when the checks fail). With a tensor-parallel group, every
    rank then joins one header exchange that either gives this shard's place in the
    vocabulary or raises the same ``ValueError`` on every rank (:mod:`rlops.logprobs._tp`).

    With a row ``mask`` on CPU where the host reads values (not while compiling) and
    ``inputs.compact``: the valid rows are found (their number read on the host) and the plan's
    rows are those only; elsewhere every row stays in the plan, with the mask as
    ``row_valid`` (no host read). ``selection``: the tensors to bind (:meth:`Plan.bound`)."""
    inputs, plan = _prepare(op, first, options, check)
    sampler, sel = plan.sampler, None
    rows, total = plan.rows, plan.rows
    if inputs.mask is not None:
        flat = inputs.mask.reshape(-1)
        # CPU only: on an accelerator RLOPS_CHECK_VALUES=1 makes the value checks read, it
        # does not switch the hot path to a host-sized compaction
        if inputs.compact and flat.device.type == "cpu" and values_checked(flat):
            sel = flat.nonzero().squeeze(1)  # a host-sized result: CPU only
            rows = sel.numel()
            sampler = None if sampler is None else sampler.compacted(sel)
        else:
            sel = flat
    s_rows = s_ids = None
    if inputs.support is not None:
        ids, offsets = inputs.support
        compacted = sel if sel is not None and sel.dtype != torch.bool else None
        s_rows, s_ids = _support.csr_entries(ids, offsets, compacted, total)
    chunk = plan.chunk if plan.chunk is not plan.rows else rows
    plan = replace(plan, rows=rows, total=total, chunk=chunk, sampler=sampler)
    return inputs, plan, (sel, s_rows, s_ids)


def _prepare(
    op: str, first: object, options: Options, check: Callable[[], Checked]
) -> tuple[Checked, Plan]:
    """The checks, the consistency check and the plan over every row."""
    rank, world = group_rank_size(options.group)
    tp_checked = world > 1 and _tp.check_enabled()
    try:
        inputs = check()
        sampler = checked_sampler(inputs.name, inputs.x, options, inputs.keep)
    except (TypeError, ValueError) as exc:
        if tp_checked:  # the other ranks are about to exchange descriptions: join, then raise
            group = cast(dist.ProcessGroup, options.group)
            _tp.fail_together(group, op, exc, getattr(first, "device", None))
        raise
    call = _header(op, inputs, options, sampler) if tp_checked else None
    start, sampler = vocab_layout(
        call, inputs.target, sampler, group=options.group, rank=rank, world=world,
        v_local=inputs.v_local, support_ids=None if inputs.support is None else inputs.support[0],
    )  # fmt: skip
    over_support = options.entropy_over_support
    rows = inputs.target.numel()
    plan = Plan(
        rows=rows,
        v_local=inputs.v_local,
        start=start,
        chunk=rows if inputs.chunk is None else inputs.chunk,  # None: one chunk (Plan.starts)
        dtype=compute_dtype(inputs.x.dtype),
        device=inputs.x.device,
        lead=tuple(inputs.x.shape[:-1]),
        temperature=inputs.temperature,
        logit_scale=inputs.logit_scale,
        softcap=inputs.softcap,
        with_entropy=options.with_entropy,
        entropy_grad=options.entropy_grad,
        sum_pi_squared=options.with_sum_pi_squared,
        masked=(
            inputs.keep is not None
            or inputs.support is not None
            or (sampler is not None and not over_support)
        ),
        sampler=sampler,
        over_support=over_support,
        group=options.group,
        world=world,
    )
    return inputs, plan


def _header(op: str, inputs: Checked, options: Options, sampler: Sampler | None) -> _tp.Call:
    """What this rank was asked to compute, for the consistency check (``sampler``: the checked
    one, its per-token tensors in the dtype the op uses)."""
    return _tp.Call(
        op=op,
        v_local=inputs.v_local,
        tokens=inputs.target.numel(),
        hidden=inputs.hidden,
        bias=inputs.bias is not None,
        dtype=inputs.x.dtype,
        with_entropy=options.with_entropy,
        entropy_grad=options.entropy_grad,
        sum_pi_squared=options.with_sum_pi_squared,
        masked=inputs.keep is not None,
        row_mask=inputs.mask,
        support=inputs.support,
        temperature=inputs.temperature,
        logit_scale=inputs.logit_scale,
        softcap=inputs.softcap,
        sampler=sampler,
        entropy_over_support=options.entropy_over_support,
    )


def checked_sampler(
    name: str, ref: torch.Tensor, options: Options, keep_mask: torch.Tensor | None
) -> Sampler | None:
    """The sampler filters of ``options`` as a :class:`_support.Sampler`, or None when none is
    given. ``ref``: the tensor ``[..., X]`` whose leading dims are the tokens (named ``name``)."""
    over = options.entropy_over_support
    check_flags(entropy_over_support=over)
    sampler = check_sampler(options.top_k, options.top_p, options.min_p, ref, name)
    if keep_mask is not None and options.support_ids is not None:
        raise ValueError(
            "keep_mask and support_ids / support_offsets are exclusive: give the support "
            "either as a dense mask or as CSR sets"
        )
    if sampler is None:
        if over:
            raise ValueError("entropy_over_support=True needs top_k, top_p or min_p")
        return None
    if keep_mask is not None or options.support_ids is not None:
        given = "keep_mask" if keep_mask is not None else "support_ids / support_offsets"
        raise ValueError(
            f"{given} and top_k / top_p / min_p are exclusive: give the sampler's support "
            "either as a mask or CSR sets, or as its parameters"
        )
    params = {"top_k": sampler.top_k, "top_p": sampler.top_p, "min_p": sampler.min_p}
    check_same_device(name, ref, **{n: p for n, p in params.items() if p is not None})
    return sampler


def vocab_layout(
    call: _tp.Call | None,
    target: torch.Tensor,
    sampler: Sampler | None,
    *,
    group: Group,
    rank: int,
    world: int,
    v_local: int,
    support_ids: torch.Tensor | None = None,
) -> tuple[int, Sampler | None]:
    """``(this shard's first vocabulary id, the sampler for the whole vocabulary)``.

    The first id comes from the consistency check's gathered shard sizes when ``call`` is given
    (shards may differ in size), else it is ``rank * v_local``. Checks the targets against the
    whole vocabulary (and the CSR ``support_ids``); an integer ``top_k`` is capped at it
    (k ≥ V keeps every token) in a new sampler, ``sampler`` itself unchanged."""
    if call is not None:
        pg = cast(dist.ProcessGroup, group)  # a group of world > 1 ranks (group_rank_size)
        start, vocab = _tp.shard_layout(pg, rank, call, target)
    else:
        start, vocab = rank * v_local, world * v_local
    check_target_range(target, vocab)
    if support_ids is not None:
        check_support_range(support_ids, vocab)
    return start, (None if sampler is None else sampler.capped(vocab))


# --------------------------------------------------------------------------- producers
class Producer:
    """How the chunks of this shard's scaled logits ``z = logits / τ`` come to be.

    A producer gives :meth:`logits`; the engine asks it for the statistics of a chunk of rows
    (:meth:`stats`) and for their gradient (:meth:`grad`), whose defaults run the torch maths on
    :meth:`logits`. ``parallel``: the chunks may run on :func:`rlops._threads.for_each` (each
    chunk writes its own rows). ``zeroes_masked_rows``: :meth:`grad` itself gives exact zeros
    on the rows a row mask drops (not compacted), so the engine does not zero them again.
    """

    parallel: bool = False
    zeroes_masked_rows: bool = False

    def logits(self, i: int, j: int) -> tuple[torch.Tensor, bool]:
        """``(z, own)``: tokens ``i:j`` of this shard's scaled logits ``[C, V_local]`` in the
        compute dtype; ``own``: ``z`` is a fresh buffer that may be overwritten."""
        raise NotImplementedError

    def sloped(self, i: int, j: int) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        """``(z, own, slope)``: :meth:`logits`, and with a softcap the slope ``τ · ∂z/∂x``
        ``[C, V_local]`` of the head's map (:meth:`rlops.logprobs._head.Head.sloped`), else
        None (a constant, the plan's ``head.grad_scale``)."""
        return (*self.logits(i, j), None)

    def stats(self, plan: Plan, i: int, j: int, out: torch.Tensor) -> None:
        """Write the statistics of tokens ``i:j`` into ``out`` ``[C, k]``: the columns of
        :func:`_shard.stats_chunk` (the target logit or 0; ``m``, ``s`` of the log-prob
        distribution; with entropy ``h``, or ``m, s, h`` of all logits when ``plan.masked``;
        last, with ``plan.sum_pi_squared``, the log-prob distribution's ``Σ p²`` in the chunk).

        With a sampler (``plan.sampler``) the support is ``z ≥ plan.threshold[i:j]``; in one
        process (``plan.world == 1``) the chunk finds that threshold itself and writes it there
        (:func:`_support.threshold_chunk`); under tensor parallelism it is given."""
        z, own = self.logits(i, j)
        idx, in_range = plan.target_index(i, j)
        keep = plan.keep_rows(i, j)
        if plan.sampler is not None and plan.threshold is not None:
            t = plan.threshold[i:j]
            if plan.world == 1:
                t.copy_(_support.threshold_chunk(z, *plan.sampler.rows(i, j)))
            z, own, keep = support_applied(z, own, idx, in_range, t, plan.over_support)
        _shard.stats_chunk(
            z, own, idx, in_range, keep,
            entropy=plan.with_entropy, squares=plan.sum_pi_squared, out=out,
        )  # fmt: skip

    def grad(self, plan: Plan, i: int, j: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The gradient with respect to the unscaled logits of tokens ``i:j`` ``[C, V_local]``
        in the compute dtype, from the backward plan's saved statistics and upstream gradients
        (the support rebuilt from ``plan.threshold``); written into ``out`` (those rows' own
        buffer) when it is given and has the compute dtype."""
        z, own, slope = self.sloped(i, j)
        idx, in_range = plan.target_index(i, j)
        keep = plan.keep_rows(i, j)
        if plan.threshold is not None:
            z, own, keep = support_applied(
                z, own, idx, in_range, plan.threshold[i:j], plan.over_support
            )
        grad = _shard.grad_chunk(
            z, own, idx, in_range, keep,
            saved=[t[i:j] for t in plan.saved],
            g_logp=None if plan.g_logp is None else plan.g_logp[i:j],
            g_ent=None if plan.g_ent is None else plan.g_ent[i:j],
            inv_tau=plan.head.grad_scale,
            out=out if slope is None else None,
        )  # fmt: skip
        if slope is None:
            return grad
        if out is not None and out.dtype == grad.dtype:  # the chain rule through the softcap
            return torch.mul(grad, slope, out=out)
        return grad.mul_(slope)


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


# --------------------------------------------------------------------------- forward
def forward(
    ctx: Any, plan: Plan, producer: Producer, inputs: tuple[torch.Tensor | None, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's autograd forward on a plan with its target bound: ``(logp, entropy,
    sum_pi_squared)`` shaped ``plan.lead`` (without entropy an empty tensor, non-differentiable
    like an entropy without gradient; ``Σ p²`` likewise, an empty tensor unless
    ``plan.sum_pi_squared``, and never differentiable). ``inputs``: the op's tensors, its
    differentiable ones first, then the target and the keep mask as given and the plan's
    :data:`Selection` (saved as they are when a gradient may be asked for). With a row mask the
    outputs are the plan's rows scattered back, exact zeros on the masked rows."""
    stats, thr = _statistics(plan, producer)
    gathered = gather_stats(stats, plan.group, plan.world)
    logp, ent, saved = _shard.merge(gathered, plan.masked, plan.with_entropy)
    if plan.sum_pi_squared:
        squares = _shard.merge_squares(gathered, plan.masked, plan.with_entropy, saved)
        sq_out = plan.expand(squares.reshape(-1))
    else:
        sq_out = logp.new_empty(0)
    ctx.set_materialize_grads(False)
    ctx.plan, ctx.n_inputs = plan.unbound(), len(inputs)
    if any(ctx.needs_input_grad[: len(inputs)]):
        packed = _shard.pack_saved(saved, plan.masked, plan.entropy_grad)
        ctx.save_for_backward(*inputs, thr, *packed)
    ent_out = plan.expand(ent.reshape(-1)) if ent is not None else logp.new_empty(0)
    constants = [sq_out]  # one call: each call replaces the previous one's list
    if ent is None or not plan.entropy_grad:
        constants.append(ent_out)
    ctx.mark_non_differentiable(*constants)
    return plan.expand(logp.reshape(-1)), ent_out, sq_out


def _statistics(plan: Plan, producer: Producer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This shard's statistics ``[N, k]`` and the sampler's threshold ``[N, 1]`` (or None)."""
    n_cols = _shard.n_columns(plan.masked, plan.with_entropy, plan.sum_pi_squared)
    stats = torch.empty((plan.rows, n_cols), dtype=plan.dtype, device=plan.device)
    thr = None
    if plan.sampler is not None:
        thr = torch.empty((plan.rows, 1), dtype=plan.dtype, device=plan.device)
        if plan.world > 1:  # first passes for the global threshold
            thr = sampler_thresholds(plan, producer)
    plan = replace(plan, threshold=thr)
    chunk = plan.chunk

    def one(i: int) -> None:
        producer.stats(plan, i, i + chunk, stats[i : i + chunk])

    _chunk_loop(one, plan.starts, plan.device, producer.parallel)
    return stats, thr


def gather_stats(stats: torch.Tensor, group: Group, world: int) -> torch.Tensor:
    """``[N, k]`` local statistics → ``[world, N, k]``: the forward's one data collective."""
    if world == 1:
        return stats.unsqueeze(0)
    out = stats.new_empty((world * stats.shape[0], stats.shape[1]))
    # Newer torch renames all_gather_into_tensor to all_gather_single and deprecates the old name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, stats.contiguous(), group=group)
    return out.view(world, stats.shape[0], stats.shape[1])


def sampler_thresholds(plan: Plan, producer: Producer) -> torch.Tensor:
    """``[N, 1]`` thresholds of the plan's sampler over the vocabulary sharded on its group,
    from this shard's scaled logits ``producer.logits(i, j)``.

    A scalar top-k (or min-p alone): each shard's candidates
    (:func:`_support.candidates_chunk`), one all-gather, the same merge everywhere. A per-token
    top-k, or top-p without top-k: the radix select (:func:`_radix.radix_threshold`), a fixed
    number of all-reduces, one more pass over the chunks per round."""
    sampler = plan.sampler
    if sampler is None:
        raise ValueError("sampler_thresholds needs a plan with a sampler")
    top_k = sampler.top_k
    if isinstance(top_k, torch.Tensor) or _radix.uses_radix(sampler):
        return _radix.radix_threshold(plan, producer.logits)
    n = plan.rows
    cand = torch.empty((n, _support.n_candidates(top_k)), dtype=plan.dtype, device=plan.device)
    for i in plan.starts:
        z = producer.logits(i, i + plan.chunk)[0]
        cand[i : i + z.shape[0]] = _support.candidates_chunk(z, top_k)
    _, top_p, min_p = sampler.rows(0, n)
    gathered = gather_stats(cand, plan.group, plan.world)
    return _support.merged_threshold(gathered, top_k, top_p, min_p)


def _chunk_loop(
    body: Callable[[int], None], starts: Iterable[int], device: torch.device, parallel: bool
) -> None:
    """``body(i)`` for every chunk start: over :func:`rlops._threads.for_each` when
    ``parallel`` (CPU), else in order."""
    if parallel:
        for_each(body, starts, device)  # type: ignore[arg-type]
    else:
        for i in starts:
            body(i)


# --------------------------------------------------------------------------- backward
def restore(
    ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None
) -> tuple[tuple[torch.Tensor, ...], Plan] | None:
    """The backward's start: ``(the op's inputs as saved by :func:`forward`, the backward
    plan)`` with the target, keep mask, row selection, CSR support, threshold, saved
    statistics and upstream gradients ``[N, 1]`` (in the compute dtype, the plan's rows)
    bound; None when no gradient flows into either output."""
    tensors = ctx.saved_tensors
    k = ctx.n_inputs
    inputs, thr, packed = tensors[:k], tensors[k], tensors[k + 1 :]
    saved, has_entropy = _shard.unpack_saved(packed)
    g_ent = g_ent if has_entropy else None
    if g_logp is None and g_ent is None:
        return None
    target, keep, sel, s_rows, s_ids = inputs[-5:]
    plan: Plan = ctx.plan.bound(target, keep, sel, None if s_rows is None else (s_rows, s_ids))
    gl = None if g_logp is None else plan.compact(g_logp).unsqueeze(1).to(plan.dtype)
    ge = None if g_ent is None else plan.compact(g_ent).unsqueeze(1).to(plan.dtype)
    plan = replace(plan, threshold=thr, saved=tuple(saved), g_logp=gl, g_ent=ge)
    return inputs, plan


def logits_grad(plan: Plan, producer: Producer, out: torch.Tensor) -> None:
    """The backward of an op on logits: the gradient of every chunk of rows written into
    ``out`` ``[N, V_local]`` (the logits' dtype; half-precision chunks are computed in float32
    and copied), over the thread pool when the producer allows it; zero on the rows a row mask
    drops."""
    chunk = plan.chunk
    if plan.rows_of is not None:  # compacted rows: the masked rows' gradient is zero
        out.zero_()
        rows_of = plan.rows_of

        def one(i: int) -> None:
            g = producer.grad(plan, i, i + chunk)
            out.index_copy_(0, rows_of[i : i + chunk], g.to(out.dtype))

    else:

        def one(i: int) -> None:
            rows = out[i : i + chunk]
            g = producer.grad(plan, i, i + chunk, rows)
            if g.dtype != out.dtype:  # half-precision logits: the chunk was computed in float32
                rows.copy_(g)
            if not producer.zeroes_masked_rows:
                plan.zero_masked(rows, i)

    _chunk_loop(one, plan.starts, out.device, producer.parallel)


def grad_with_graph(
    plan: Plan, logits: torch.Tensor, op: str, *, compacted: bool = False
) -> torch.Tensor:
    """Gradient w.r.t. the unscaled logits ``[N, V]`` as a differentiable function of them and
    of the upstream gradients: the backward when autograd records it (double backward).

    ``compacted``: ``logits`` are already the plan's rows (the valid rows of a compacted row
    mask), and so is the result; else they are all the rows, and so is the result, zero on the
    masked rows.

    One process only: with a sharded vocabulary the second derivatives couple the shards (and
    the replicated outputs' gradients would be partial per rank), so it raises RuntimeError.
    """
    if plan.world > 1:
        raise RuntimeError(
            f"double backward (create_graph=True) through {op} is not supported with a "
            f"tensor-parallel group of {plan.world} ranks; use the unfused reference "
            "(rlops.logprobs.reference) on the full vocabulary for higher derivatives"
        )
    if plan.target is None:
        raise RuntimeError("grad_with_graph needs a plan with its target bound")
    rows = logits if plan.rows_of is None or compacted else logits.index_select(0, plan.rows_of)
    head = plan.head
    x = rows.to(compute_dtype(logits.dtype))
    z = x / plan.temperature if head.plain else head.differentiable(x)
    idx = plan.target.reshape(-1, 1)
    keep = plan.keep_rows(0, plan.rows)  # the plan's rows, from the keep mask or CSR sets
    if plan.threshold is not None:  # the sampler's support, piecewise constant: no graph
        keep = z.detach() >= plan.threshold.reshape(-1, 1)
        if plan.over_support:
            keep = keep.scatter(1, idx, True)
            z = z.masked_fill(~keep, float("-inf"))
            keep = None
    if head.plain:
        grad = _shard.grad_differentiable(z, idx, keep, plan.g_logp, plan.g_ent, plan.inv_tau)
    else:  # ∂L/∂z, times ∂z/∂x as a function of x (its own derivative enters the next order)
        grad = _shard.grad_differentiable(z, idx, keep, plan.g_logp, plan.g_ent, 1.0)
        u = x * head.logit_scale if head.logit_scale != 1.0 else x
        slope = head.logit_scale / head.temperature
        if head.softcap is not None:
            grad = grad * ((1.0 - torch.tanh(u / head.softcap) ** 2) * slope)
        else:
            grad = grad * slope
    if plan.rows_of is not None and not compacted:
        grad = grad.new_zeros(logits.shape[0], grad.shape[1]).index_copy(0, plan.rows_of, grad)
    elif plan.row_valid is not None:
        grad = grad.masked_fill(~plan.row_valid.unsqueeze(1), 0.0)
    return grad.to(logits.dtype)
