"""The chunk engine under the log-prob ops: the preamble, the chunk loops, the producer
interface and its fallback after a kernel's build failure.

Both ops run it on a :class:`~rlops.logprobs._plan.Plan` and differ in their :class:`Producer`
(how a chunk of this shard's scaled logits comes to be) and in what their backward does with the
logits' gradient. :func:`prepare` checks (:mod:`rlops.logprobs._options`), joins the group check
and plans; :func:`forward` runs the statistics, the one collective and the merge;
:func:`restore` gives the backward its plan. ``docs/design/logprobs.md`` has the protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, cast

import torch
import torch.distributed as dist

from rlops._backends import KernelBuildError
from rlops._checks import values_checked
from rlops._threads import for_each
from rlops.distributed.groups import group_rank_size
from rlops.logprobs import _softmax, _support
from rlops.logprobs import _tensor_parallel as _tp
from rlops.logprobs._options import Checked, Options, checked, failed, set_failed
from rlops.logprobs._plan import Plan

# What a public op returns: (logp, entropy) or (logp, entropy, sum_pi_squared).
Outputs = (
    tuple[torch.Tensor, torch.Tensor | None]
    | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]
)
# The tensors a plan binds beside the target and the keep mask: the row selection (int64 rows
# or a bool mask) and the CSR support's (rows, ids); passed to the autograd functions and saved.
Selection = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


# --------------------------------------------------------------------------- the preamble
def prepare(
    op: str,
    options: Options,
    name: str,
    x: object,
    target: object,
    *,
    weight: object = None,
    bias: object = None,
    method: object = None,
) -> tuple[Checked, Plan, Selection]:
    """The preamble of the op named ``op`` on ``x`` (``name``: ``"logits"``, with ``method``
    choosing the producer, or ``"hidden"`` with ``weight`` and ``bias``): ``(checked inputs,
    plan, selection)``. A row mask on CPU where values are read is compacted to
    its valid rows; elsewhere it stays as ``row_valid`` (no host read)."""
    inputs, plan = _checked_plan(op, options, name, x, target, (weight, bias, method))
    sampler, sel = plan.sampler, None
    rows, total = plan.rows, plan.rows
    if inputs.mask is not None:
        flat = inputs.mask.reshape(-1)
        # CPU only: on an accelerator RLOPS_CHECK_VALUES=1 makes the value checks read, it
        # does not switch the hot path to a host-sized compaction
        compact = inputs.method != "triton"  # the kernels' masked programs return at once
        if compact and flat.device.type == "cpu" and values_checked(flat):
            sel = flat.nonzero().squeeze(1)  # a host-sized result: CPU only
            rows = sel.numel()
            sampler = None if sampler is None else sampler.compacted(sel)
            tau = plan.temperature
            if isinstance(tau, torch.Tensor):
                plan = replace(plan, temperature=tau.index_select(0, sel))
        else:
            sel = flat
    s_rows = s_ids = None
    if inputs.support is not None:
        ids, offsets = inputs.support
        compacted = sel if sel is not None and sel.dtype != torch.bool else None
        s_rows, s_ids = _support.csr_entries(ids, offsets, compacted, total)
    chunk = plan.chunk if plan.chunk is not plan.rows else rows
    plan = replace(plan, rows=rows, total=total, chunk=chunk, sampler=sampler)
    if inputs.method == "triton" and options.chunk_size is None and plan.sampler is None:
        plan = replace(plan, chunk=max(plan.rows, 1))  # the kernels need no [chunk, V] buffer
    return inputs, plan, (sel, s_rows, s_ids)


def _checked_plan(
    op: str, options: Options, name: str, x: object, target: object, rest: tuple
) -> tuple[Checked, Plan]:
    """The checks (a rank that fails joins the group check, then raises), the group check and
    the plan over every row."""
    rank, world = group_rank_size(options.group)
    tp_checked = world > 1 and _tp.check_enabled()
    weight, bias, method = rest
    try:
        inputs = checked(name, x, target, options, weight=weight, bias=bias, method=method)
    except (TypeError, ValueError) as exc:
        if tp_checked:  # the other ranks are about to exchange descriptions: join, then raise
            group = cast(dist.ProcessGroup, options.group)
            _tp.fail_together(group, op, exc, getattr(x, "device", None))
        raise
    sampler = inputs.sampler
    call = _tp.call_of(op, inputs, options, sampler) if tp_checked else None
    start, sampler = _tp.vocab_layout(
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
        dtype=inputs.dtype,
        logits_dtype=inputs.logits_dtype,
        device=inputs.x.device,
        lead=tuple(inputs.x.shape[:-1]),
        temperature=(
            inputs.temperature.unsqueeze(1)
            if isinstance(inputs.temperature, torch.Tensor)
            else inputs.temperature
        ),
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


# --------------------------------------------------------------------------- producers
class Producer:
    """How the chunks of this shard's scaled logits come to be: :meth:`logits`, and :meth:`stats`
    and :meth:`grad`, the torch maths by default. ``parallel``: chunks may run on the thread pool;
    ``zeroes_masked_rows``, ``threshold_given``, ``fallback``: ``docs/design/logprobs.md``."""

    parallel: bool = False
    zeroes_masked_rows: bool = False
    threshold_given: bool = False
    fallback: Producer | None = None

    def logits(self, i: int, j: int) -> tuple[torch.Tensor, bool]:
        """``(z, own)``: tokens ``i:j`` of the scaled logits ``[C, V_local]`` in the compute
        dtype; ``own``: a fresh buffer that may be overwritten."""
        raise NotImplementedError

    def sloped(self, i: int, j: int) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        """``(z, own, slope)``: :meth:`logits` and, with a softcap, ``τ·∂z/∂x`` ``[C, V_local]``
        (:meth:`~rlops.logprobs._softmax.Head.sloped`), else None."""
        return (*self.logits(i, j), None)

    def stats(
        self, plan: Plan, i: int, j: int, keep: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        """Write the statistics of tokens ``i:j`` into ``out`` ``[C, k]`` (the columns of
        :func:`~rlops.logprobs._softmax.stats_chunk`); ``keep``: the chunk's keep mask. With a
        sampler the support is ``z ≥ plan.threshold[i:j]``, found here in one process."""
        z, own = self.logits(i, j)
        idx, in_range = plan.target_index(i, j)
        if plan.sampler is not None and plan.threshold is not None:
            t = plan.threshold[i:j]
            if plan.world == 1 and not self.threshold_given:
                t.copy_(_support.threshold_chunk(z, *plan.sampler.rows(i, j)))
            z, own, keep = _support.support_applied(z, own, idx, in_range, t, plan.over_support)
        _softmax.stats_chunk(
            z, own, idx, in_range, keep,
            entropy=plan.with_entropy, squares=plan.sum_pi_squared, out=out,
        )  # fmt: skip

    def grad(
        self, plan: Plan, i: int, j: int, keep: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The gradient w.r.t. the unscaled logits of tokens ``i:j`` ``[C, V_local]`` in the
        compute dtype, from the backward plan; written into ``out`` when it has that dtype."""
        z, own, slope = self.sloped(i, j)
        idx, in_range = plan.target_index(i, j)
        if plan.threshold is not None:
            z, own, keep = _support.support_applied(
                z, own, idx, in_range, plan.threshold[i:j], plan.over_support
            )
        grad = _softmax.grad_chunk(
            z, own, idx, in_range, keep,
            saved=[t[i:j] for t in plan.saved],
            g_logp=None if plan.g_logp is None else plan.g_logp[i:j],
            g_ent=None if plan.g_ent is None else plan.g_ent[i:j],
            inv_tau=plan.head.rows(i, j).grad_scale,
            out=out if slope is None else None,
        )  # fmt: skip
        if slope is None:
            return grad
        if out is not None and out.dtype == grad.dtype:  # the chain rule through the softcap
            return torch.mul(grad, slope, out=out)
        return grad.mul_(slope)


def _running(producer: Producer, run: Callable[[Producer], Any]) -> tuple[Any, Producer]:
    """``(run(p), p)``: ``p`` the producer, or its fallback once the kernels are set aside (a
    build error on this call sets them aside, warns once, and runs the fallback)."""
    fallback = producer.fallback
    if fallback is None:
        return run(producer), producer
    if failed() is None:
        try:
            return run(producer), producer
        except KernelBuildError as e:
            set_failed(e)
    return run(fallback), fallback


# --------------------------------------------------------------------------- forward
def forward(
    ctx: Any, plan: Plan, producer: Producer, inputs: tuple[torch.Tensor | None, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The autograd forward on a bound plan: ``(logp, entropy, sum_pi_squared)`` shaped
    ``plan.lead`` (an empty tensor for an output not asked for), exact zeros on masked rows.
    ``inputs``: the op's tensors, differentiable ones first, then the target, the keep mask
    and the :data:`Selection` (saved when a gradient may be asked for)."""
    stats, thr = _statistics(plan, producer)
    gathered = _tp.gather_stats(stats, plan.group, plan.world)
    logp, ent, saved = _softmax.merge(gathered, plan.masked, plan.with_entropy)
    if plan.sum_pi_squared:
        squares = _softmax.merge_squares(gathered, plan.masked, plan.with_entropy, saved)
        sq_out = plan.expand(squares.reshape(-1))
    else:
        sq_out = logp.new_empty(0)
    ctx.set_materialize_grads(False)
    ctx.plan, ctx.n_inputs = plan.unbound(), len(inputs)
    if any(ctx.needs_input_grad[: len(inputs)]):
        packed = _softmax.pack_saved(saved, plan.masked, plan.entropy_grad)
        ctx.save_for_backward(*inputs, thr, *packed)
    ent_out = plan.expand(ent.reshape(-1)) if ent is not None else logp.new_empty(0)
    constants = [sq_out]  # one call: each call replaces the previous one's list
    if ent is None or not plan.entropy_grad:
        constants.append(ent_out)
    ctx.mark_non_differentiable(*constants)
    return plan.expand(logp.reshape(-1)), ent_out, sq_out


def _statistics(plan: Plan, producer: Producer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This shard's statistics ``[N, k]`` and the sampler's threshold ``[N, 1]`` (or None)."""
    n_cols = _softmax.n_columns(plan.masked, plan.with_entropy, plan.sum_pi_squared)
    stats = torch.empty((plan.rows, n_cols), dtype=plan.dtype, device=plan.device)
    thr = None
    if plan.sampler is not None:
        thr = torch.empty((plan.rows, 1), dtype=plan.dtype, device=plan.device)
        if plan.world > 1:  # first passes for the global threshold
            thr = sampler_thresholds(plan, producer)
    plan = replace(plan, threshold=thr)
    chunk, sampler = plan.chunk, plan.sampler
    find = sampler if plan.world == 1 and producer.threshold_given else None

    def one(i: int) -> None:
        j = i + chunk
        keep = plan.keep_rows(i, j)
        if find is not None and thr is not None and failed() is None:  # the chunk's threshold
            z = producer.logits(i, j)[0]
            thr[i:j].copy_(_support.threshold_chunk(z, *find.rows(i, j)))
        _running(producer, lambda p: p.stats(plan, i, j, keep, stats[i:j]))

    _chunk_loop(one, plan.starts, plan.device, producer.parallel)
    return stats, thr


def sampler_thresholds(plan: Plan, producer: Producer) -> torch.Tensor:
    """``[N, 1]`` thresholds of the plan's sampler over the vocabulary sharded on its group:
    a scalar top-k (or min-p alone) merges each shard's candidates in one all-gather; a
    per-token top-k, or top-p without top-k, runs the radix select."""
    sampler = plan.sampler
    if sampler is None:
        raise ValueError("sampler_thresholds needs a plan with a sampler")
    top_k = sampler.top_k
    if isinstance(top_k, torch.Tensor) or _support.uses_radix(sampler):
        return _support.radix_threshold(plan, producer.logits)
    n = plan.rows
    cand = torch.empty((n, _support.n_candidates(top_k)), dtype=plan.dtype, device=plan.device)
    for i in plan.starts:
        z = producer.logits(i, i + plan.chunk)[0]
        cand[i : i + z.shape[0]] = _support.candidates_chunk(z, top_k)
    _, top_p, min_p = sampler.rows(0, n)
    gathered = _tp.gather_stats(cand, plan.group, plan.world)
    return _support.merged_threshold(gathered, top_k, top_p, min_p)


def _chunk_loop(
    body: Callable[[int], None], starts: Iterable[int], device: torch.device, parallel: bool
) -> None:
    """``body(i)`` for every chunk start: over the thread pool when ``parallel``, else in order."""
    if parallel:
        for_each(body, starts, device)  # type: ignore[arg-type]
    else:
        for i in starts:
            body(i)


# --------------------------------------------------------------------------- backward
def restore(
    ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None
) -> tuple[tuple[torch.Tensor, ...], Plan] | None:
    """The backward's start: ``(the op's inputs as saved, the backward plan)`` with every
    tensor bound and the upstream gradients ``[N, 1]`` in the compute dtype; None when no
    gradient flows into either output."""
    tensors = ctx.saved_tensors
    k = ctx.n_inputs
    inputs, thr, packed = tensors[:k], tensors[k], tensors[k + 1 :]
    saved, has_entropy = _softmax.unpack_saved(packed)
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
    """The backward of the op on logits: every chunk's gradient written into ``out``
    ``[N, V_local]`` (the logits' dtype), zero on the rows a row mask drops."""
    chunk = plan.chunk
    if plan.rows_of is not None:  # compacted rows: the masked rows' gradient is zero
        out.zero_()
        rows_of = plan.rows_of

        def one(i: int) -> None:
            keep = plan.keep_rows(i, i + chunk)
            g, _ = _running(producer, lambda p: p.grad(plan, i, i + chunk, keep))
            out.index_copy_(0, rows_of[i : i + chunk], g.to(out.dtype))

    else:

        def one(i: int) -> None:
            rows = out[i : i + chunk]
            keep = plan.keep_rows(i, i + chunk)
            g, ran = _running(producer, lambda p: p.grad(plan, i, i + chunk, keep, rows))
            if g.dtype != out.dtype:  # half-precision logits: the chunk was computed in float32
                rows.copy_(g)
            if not ran.zeroes_masked_rows:
                plan.zero_masked(rows, i)

    _chunk_loop(one, plan.starts, out.device, producer.parallel)


def grad_with_graph(
    plan: Plan, logits: torch.Tensor, op: str, *, compacted: bool = False
) -> torch.Tensor:
    """Gradient w.r.t. the unscaled logits ``[N, V]`` as a differentiable function of them and
    of the upstream gradients (double backward, one process only). ``compacted``: ``logits``
    are already the plan's rows, and so is the result; else all rows, zero on masked ones."""
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
    x = rows.to(plan.dtype)
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
        grad = _softmax.grad_differentiable(z, idx, keep, plan.g_logp, plan.g_ent, plan.inv_tau)
    else:  # ∂L/∂z, times ∂z/∂x as a function of x (its own derivative enters the next order)
        grad = _softmax.grad_differentiable(z, idx, keep, plan.g_logp, plan.g_ent, 1.0)
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
