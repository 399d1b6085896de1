"""Aggregation of a per-token loss matrix into a scalar, layout-invariant with a global
normaliser, exact under context parallelism (rows split over ``cp_group``) and per sequence
for packed rows (``seq_ids``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypedDict, cast

import torch
from typing_extensions import Unpack  # torch's own dependency (typing.Unpack: 3.11+)

from rlops._checks import (
    as_bool_mask,
    check_2d,
    compute_dtype,
    read_value,
    values_checked,
)
from rlops._types import CPLayout, EmptyRows, Group
from rlops.distributed.collectives import Call, check_enabled, fails_together, gather
from rlops.distributed.rows import Rows
from rlops.losses._checks import AGG_MODES, check_agg, check_normalisers

__all__ = [
    "AGG_MODES",
    "Aggregation",
    "AggregationOptions",
    "aggregate_loss",
    "loss_and_metrics",
]


class AggregationOptions(TypedDict, total=False):
    """The keyword arguments that every loss of the package passes to its aggregation
    (:func:`aggregate_loss`, :func:`~rlops.losses.policy_loss`,
    :func:`~rlops.losses.value_loss`, :func:`~rlops.losses.entropy_loss`): the global
    normalisers, the data- and context-parallel groups, the packed sequences and the rule for
    rows without an action token. Each is optional; :func:`aggregate_loss` explains what they
    mean together.

    Attributes:
        loss_scale_factor: ``L`` for ``seq-mean-token-sum-norm`` (``> 0``); ignored otherwise.
            Default None (``T``).
        num_tokens: action tokens of the global batch, for ``token-mean``: a finite number
            ``>= 0`` or a 0-dim tensor (a constant: detached). 0 is for a call without action
            tokens (its loss is 0, with gradient 0: a rank with nothing to do still joins);
            with action tokens it raises ``ValueError``. Negative, NaN or infinite counts raise
            ``ValueError`` when given as a number or a CPU tensor; a tensor on an accelerator
            is not read (no host synchronisation, unless ``RLOPS_CHECK_VALUES=1``): there such a
            count gives a non-finite loss instead (``x/0``, NaN). A tensor on the meta device
            raises ``ValueError`` unless the loss is on the meta device too. Default None (this
            call's own count).
        num_seqs: rows with an action token in the global batch, for the seq-mean modes; the
            same rules as ``num_tokens``.
        group: a data-parallel process group with one micro-batch per rank, instead of the two
            counts (DP×CP with ``cp_group``). Default None.
        cp_group: the context-parallel group whose ranks hold pieces of the same rows (the
            ranks' losses sum to the whole rows' loss, each rank's gradient is the whole rows'
            gradient on its tokens), or None (the default).
        cp_layout: ``"zigzag"`` (the default) or ``"contiguous"``: how rows are split over
            ``cp_group``.
        seq_ids: None, or ``[B, T]`` integer ids of the packed sequences (ids of mask-0 tokens
            are ignored; those of action tokens must lie in ``[0, seqs_per_row)``).
        seqs_per_row: with ``seq_ids``, the number ``K`` of sequence slots per row (an int,
            the same on every rank).
        empty_rows: ``"skip"`` (the default) or ``"count"``: whether rows without an action
            token count in ``S`` (not with ``seq_ids``: pass ``num_seqs`` there).
    """

    loss_scale_factor: float | None
    num_tokens: float | torch.Tensor | None
    num_seqs: float | torch.Tensor | None
    group: Group
    cp_group: Group
    cp_layout: CPLayout
    seq_ids: torch.Tensor | None
    seqs_per_row: int | None
    empty_rows: EmptyRows


#: the keys of :class:`AggregationOptions`
AGGREGATION_KEYS = frozenset(AggregationOptions.__annotations__)


# --------------------------------------------------------------------------- normalisers
@dataclass
class Aggregation:
    """A loss call's checked aggregation: its mode, the normaliser ``L`` of
    ``seq-mean-token-sum-norm``, the global counts, the data-parallel ``group`` and the rows
    (:class:`Rows`: the bool mask, the context-parallel group and layout, the packed
    sequences). Made once per public call by :meth:`checked`; :meth:`describe` then says what
    the ranks of a group must agree on, and :meth:`reduce` aggregates the per-token loss and
    the metrics."""

    mode: str | None
    loss_scale_factor: float | None
    num_tokens: float | torch.Tensor | None
    num_seqs: float | torch.Tensor | None
    group: Group
    rows: Rows
    dtype: torch.dtype

    @classmethod
    def checked(
        cls,
        fn: str,
        keep: torch.Tensor,
        ref: torch.Tensor,
        mode: object,
        options: Mapping[str, object],
        *,
        mode_name: str = "agg",
        optional: bool = True,
    ) -> Aggregation:
        """Check ``mode`` (``None`` allowed where ``optional``: the per-token matrix) and the
        :class:`AggregationOptions` of a call of ``fn`` (``keep``: its bool mask; ``ref``: its
        loss input, whose dtype gives the computation's). Under context parallelism
        ``seq-mean-token-sum-norm`` needs ``loss_scale_factor`` (a shard does not know the
        whole row's ``T``)."""
        unknown = sorted(set(options) - AGGREGATION_KEYS)
        if unknown:
            raise TypeError(
                f"{fn}() got unexpected keyword argument(s) {unknown}; the aggregation's are "
                f"{sorted(AGGREGATION_KEYS)}"
            )
        opt = cast(AggregationOptions, options)
        lsf = check_agg(mode_name, mode, opt.get("loss_scale_factor"), optional=optional)
        group = opt.get("group")
        counts = check_normalisers(opt.get("num_tokens"), opt.get("num_seqs"), group, ref)
        dtype = compute_dtype(ref.dtype)
        rows = Rows(
            keep,
            dtype,
            cp_group=opt.get("cp_group"),
            cp_layout=opt.get("cp_layout", "zigzag"),
            seq_ids=opt.get("seq_ids"),
            seqs_per_row=opt.get("seqs_per_row"),
            group=group,
            empty_rows=opt.get("empty_rows", "skip"),
        )
        if rows.cp and mode == "seq-mean-token-sum-norm" and lsf is None:
            raise ValueError(
                "agg='seq-mean-token-sum-norm' with cp_group needs loss_scale_factor (the "
                "constant L, e.g. the whole row's length): a shard's own T is not the row's"
            )
        return cls(cast(str | None, mode), lsf, *counts, group, rows, dtype)

    def describe(self, op: str, implied: dict | None = None, **fields: object) -> Call:
        """What a call on a group must agree on: the function ``op``, its aggregation mode,
        the normaliser ``L`` of ``seq-mean-token-sum-norm`` (``loss_scale_factor``, else
        ``T``: the same on every micro-batch), the rows' context-parallel and packing
        arguments and the function's own ``fields``. Sets ``rows.call``."""
        norm = None
        if self.mode == "seq-mean-token-sum-norm":
            lsf = self.loss_scale_factor
            norm = lsf if lsf is not None else float(self.rows.keep.shape[-1])
        call = Call(
            op,
            implied=implied,
            agg=self.mode,
            **{"loss_scale_factor (or T)": norm},
            **self.rows.fields(),
            **fields,
        )
        self.rows.call = call
        return call

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in the computation dtype, 0 off the action tokens (before any arithmetic:
        NaN or inf there reaches neither the loss nor its gradient)."""
        return torch.where(self.rows.keep, x.to(self.dtype), 0)

    def reduce(
        self,
        loss_mat: torch.Tensor,
        call: Call,
        metric_sums: dict[str, tuple[torch.Tensor, str]] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The aggregated ``loss_mat`` (0 off the action tokens) and the metrics of
        ``metric_sums``: :func:`loss_and_metrics`."""
        return loss_and_metrics(
            loss_mat,
            self.rows,
            self.mode,
            self.loss_scale_factor,
            self.dtype,
            self.num_tokens,
            self.num_seqs,
            self.group,
            call,
            metric_sums or {},
        )


_SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _needs_count(mode: str | None) -> bool:
    return mode is not None and mode != "token-sum"


def _needs_rows(mode: str | None, num_seqs: object) -> bool:
    """Whether ``mode`` needs whole-row counts: the row length of seq-mean-token-mean, the
    number of rows ``S`` of the other seq-mean modes unless ``num_seqs`` gives it."""
    return mode == "seq-mean-token-mean" or (mode in _SEQ_MODES and num_seqs is None)


def _given(
    keep: torch.Tensor,
    mode: str | None,
    dtype: torch.dtype,
    num_tokens: float | torch.Tensor | None,
    num_seqs: float | torch.Tensor | None,
) -> float | torch.Tensor | None:
    """The given count of ``mode`` (``num_tokens`` / ``num_seqs``), else None: a positive
    number stays a Python number, a tensor stays on its device (no host round trip).

    A given count of 0 is 1 when this call has no action token (its loss is 0 and so is its
    gradient: a rank with nothing to do in data parallelism) and a ``ValueError`` when it has
    one, where the values are read (see ``read_value``); where they are not, the count is used
    as it is, so that a 0 with action tokens (or a negative count: NaN) gives a non-finite
    loss rather than a silently rescaled one."""
    if not _needs_count(mode):
        return None
    name, value = ("num_tokens", num_tokens) if mode == "token-mean" else ("num_seqs", num_seqs)
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):  # a number enters the division as a number
        if value > 0:
            return float(value)
        n = torch.zeros((), dtype=dtype, device=keep.device)  # made on the device, no copy
    else:
        n = value.to(dtype)
    known = value if not isinstance(value, torch.Tensor) else read_value(value)
    if known is not None and known > 0:
        return n
    if known == 0 and keep.device.type != "meta" and values_checked(keep):
        if bool(keep.any()):
            raise ValueError(
                f"{name} is 0 but this call has action tokens (mask 1): give the global "
                f"count of the batch, at least this call's own ({name} = 0 is only for a "
                "call without action tokens, whose loss is then 0)"
            )
        return torch.ones_like(n)
    n = torch.where(n < 0, math.nan, n)
    return torch.where((n == 0) & ~keep.any(), 1, n)


# --------------------------------------------------------------------------- aggregation
def _aggregate(
    x: torch.Tensor,
    rows: Rows,
    mode: str | None,
    loss_scale_factor: float | None,
    denom: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """``mode`` reduction of ``x``, which must already be 0 where ``rows.keep`` is False;
    ``mode=None`` returns ``x`` itself (the per-token matrix). ``denom`` is the global
    normaliser (tokens for token-mean, sequences for the seq-mean modes), None for this call's
    own count. A seq-mean mode divides this rank's partial row sums by the whole rows' counts
    (:class:`Rows`), so the shares of a row's context-parallel ranks sum to its term."""
    if mode is None:
        return x
    if mode == "token-sum":
        return x.sum()
    if mode == "token-mean":
        n = rows.keep.sum().to(x.dtype).clamp_min(1) if denom is None else denom
        return x.sum() / n
    seq = rows.local(x)
    if mode == "seq-mean-token-mean":
        seq = seq / rows.count.to(x.dtype).clamp_min(1)
    n = rows.nonempty.sum().to(x.dtype).clamp_min(1) if denom is None else denom
    out = seq.sum() / n
    if mode == "seq-mean-token-sum-norm":
        out = out / (x.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return out


def loss_and_metrics(
    loss_mat: torch.Tensor,
    rows: Rows,
    agg: str | None,
    loss_scale_factor: float | None,
    dtype: torch.dtype,
    num_tokens: float | torch.Tensor | None,
    num_seqs: float | torch.Tensor | None,
    group: Group,
    call: Call,
    metric_sums: dict[str, tuple[torch.Tensor, str]],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``agg`` of ``loss_mat`` and the metrics: ``metric_sums`` maps a name to ``(sum, per)``
    with ``per`` "tokens" or "rows" (a row sum counted on :attr:`Rows.counted` rows); the
    metric is the sum over the action tokens (or the rows with one) of this call — of the whole
    rows of ``cp_group``, of the whole ``group`` — divided by their number. Arguments checked.

    Collectives: without ``cp_group`` one over ``group`` (counts, normaliser and metrics), none
    without it. With ``cp_group`` and no ``group``: one over ``cp_group`` (the whole-row counts
    where a seq-mean mode needs them, the token count and the metric sums), or, after the
    kind's own row summaries, one more for the metrics. With both: the row summaries over
    ``cp_group`` (always where the consistency check is on: the first collective of every CP
    rank is then over ``cp_group``, so mismatched calls raise instead of waiting on two
    groups), then one over ``group``."""
    keep = rows.keep
    names = list(metric_sums)
    local = [v.detach().to(torch.float64) for v, _ in metric_sums.values()]
    # empty_rows="count": the number of sequences is every row's, summed with the totals
    all_rows = rows.empty_rows == "count" and agg in _SEQ_MODES and num_seqs is None
    if all_rows:
        local.append(rows.all_rows)
    need_rows = _needs_rows(agg, num_seqs)
    check = check_enabled()
    given = _given(keep, agg, dtype, num_tokens, num_seqs)
    tokens_l = keep.sum().to(torch.float64)

    def rows_l() -> torch.Tensor:
        return rows.counted.sum().to(torch.float64)

    reduce_now = bool(names) or (agg == "token-mean" and given is None) or need_rows or check
    if rows.cp and group is None:
        if not reduce_now:
            tot_tokens, totals = tokens_l, local
        elif need_rows and not rows.known:  # one collective: the rows' counts and the totals
            got = rows.reduce(
                scalars=torch.stack([tokens_l, *local]), step="row counts and totals"
            )[2]
            assert got is not None
            tot_tokens, totals = got[0], list(got[1:])
        else:
            vec = gather(
                torch.stack([tokens_l, *local]),
                rows.cp_group,
                call.with_fields(collective="totals"),
                "cp_group",
            ).sum(0)
            # (after the kind's row summaries, or alone where no row count is needed)
            tot_tokens, totals = vec[0], list(vec[1:])
        tot_rows = rows.nonempty.sum().to(torch.float64) if rows.known else tokens_l * 0
    elif rows.cp:
        if not rows.known and (need_rows or check):
            rows.reduce(step="row counts")
        counted = rows_l() if rows.known else tokens_l * 0
        vec = torch.stack([tokens_l, counted, *local])
        if reduce_now:
            vec = gather(vec, group, call).sum(0)
        tot_tokens, tot_rows, totals = vec[0], vec[1], list(vec[2:])
    else:
        per_row = group is not None or any(per == "rows" for _, per in metric_sums.values())
        vec = torch.stack([tokens_l, rows_l() if per_row else tokens_l * 0, *local])
        if group is not None and reduce_now:
            vec = gather(vec, group, call).sum(0)
        tot_tokens, tot_rows, totals = vec[0], vec[1], list(vec[2:])
    denom = given
    if all_rows:
        denom = totals.pop().to(dtype).clamp_min(1)
    if denom is None and _needs_count(agg) and (group is not None or rows.cp):
        count = tot_tokens if agg == "token-mean" else tot_rows
        denom = count.to(dtype).clamp_min(1)
    metrics = {
        k: (s / (tot_tokens if per == "tokens" else tot_rows).clamp_min(1)).to(dtype)
        for k, s, (_, per) in zip(names, totals, metric_sums.values(), strict=True)
    }
    return _aggregate(loss_mat, rows, agg, loss_scale_factor, denom), metrics


@fails_together()
def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    **options: Unpack[AggregationOptions],
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar, with verl's ``loss_agg_mode`` names.

    With ``m`` the mask, ``n_b = Σ_t m[b,t]``, ``N`` the number of action tokens and ``S`` the
    number of rows with ``n_b > 0``::

        token-mean               Σ_{b,t} m·ℓ / N
        token-sum                Σ_{b,t} m·ℓ
        seq-mean-token-sum       (1/S) Σ_b Σ_t m·ℓ
        seq-mean-token-mean      (1/S) Σ_b (Σ_t m·ℓ) / n_b
        seq-mean-token-sum-norm  (1/S) Σ_b Σ_t m·ℓ / L      (Dr.GRPO; L = loss_scale_factor or T)

    **Layout invariance.** By default ``N`` and ``S`` are this call's own counts. Pass the counts
    of the whole global batch — ``num_tokens=N`` (token-mean) and ``num_seqs=S`` (the seq-mean
    modes), or ``group=`` when each rank of a process group holds one micro-batch (then ``N``
    and ``S`` are summed over the group in one ``all_gather``) — and each call returns its
    micro-batch's *share*: the losses of all micro-batches on all ranks **sum** to the loss of
    the full batch, and so do their gradients::

        Σ_micro-batches Σ_ranks aggregate_loss(ℓ_i, m_i, mode, num_tokens=N, num_seqs=S)
            == aggregate_loss(ℓ, m, mode)

    So sum the micro-batch losses (or accumulate their gradients) and *sum* gradients over
    ranks. verl's convention differs by a factor: its ``agg_loss`` multiplies each rank's share
    by ``dp_size`` because DDP/FSDP *average* gradients over data-parallel ranks
    (``rlops.compat.verl.agg_loss`` keeps that). ``token-sum`` needs no normaliser and
    ``seq-mean-token-sum-norm`` needs the same ``L`` on every micro-batch (pass
    ``loss_scale_factor`` when ``T`` varies). Counts may be 0-dim tensors on the device (they
    are not read on the host). A count of 0 gives 0 on a call without action tokens and is an
    error on one with action tokens (never silently taken as 1).

    **Context parallelism** (``cp_group=``: each row is split over the ranks of ``cp_group``,
    in any order — ``cp_layout`` ``"zigzag"`` (Megatron's) or ``"contiguous"``; sums need no
    order, the argument is checked and compared across ranks). The ranks' losses **sum** to the
    loss of the whole rows, and each rank's gradient is the whole rows' gradient on its tokens:
    under ``token-mean`` each rank divides its token sum by the whole ``N``; under the seq-mean
    modes each rank divides its *partial* row sum by the whole row's ``n_b`` and by the whole
    ``S``. The whole rows' counts come from one collective of ``[B]`` (``[B, K]`` packed)
    counts over ``cp_group``; nothing of size ``T`` crosses ranks. With data parallelism as
    well, ``group`` must be the DP×CP group (every rank holding a token of the batch; checked
    to contain ``cp_group``): ``N`` is summed over it and each row is counted once (by CP
    rank 0), in one more collective. ``seq-mean-token-sum-norm`` then needs
    ``loss_scale_factor`` (a shard does not know the row's ``T``).

    **Rows without an action token** (``empty_rows``): ``"skip"`` (the default, as verl)
    leaves them out of ``S``; ``"count"`` counts every row, ``S = B`` summed over ``group``
    (each row once over DP×CP), as TRL's ``grpo`` and ``dr_grpo`` losses divide by the batch's
    rows. They add 0 to the sums either way. ``num_seqs``, when given, is ``S`` itself.

    **Packed rows** (``seq_ids=``, ``[B, T]`` integers in ``[0, seqs_per_row)``: the sequence
    of the row each token belongs to): every "row" above is a sequence — ``n_b`` its action
    tokens, ``S`` the sequences with one. From ``dones`` (1 on each sequence's last token),
    before sharding the row: ``seq_ids = dones.cumsum(-1) - dones``.

    ``seq-mean-token-sum-norm`` is Dr.GRPO's objective (https://arxiv.org/abs/2503.20783):
    the mean over sequences of each sequence's token *sum*, divided by a constant ``L`` instead
    of each sequence's own length (verl's definition since February 2026; earlier releases
    divided the plain token sum by ``L``). An empty batch gives 0.

    Args:
        loss_mat: ``[B, T]`` per-token loss.
        mask: ``[B, T]`` 0/1 action mask.
        mode: one of :data:`AGG_MODES`.
        **options: the global normalisers (``num_tokens``, ``num_seqs``,
            ``loss_scale_factor``), the groups (``group``, ``cp_group``, ``cp_layout``), the
            packed sequences (``seq_ids``, ``seqs_per_row``) and ``empty_rows``, each
            described in :class:`AggregationOptions`; another keyword is a ``TypeError``.

    Returns:
        0-dim tensor, float32 for half inputs, else ``loss_mat``'s dtype. Differentiable.

    Example:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> m = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> [round(aggregate_loss(loss, m, mode).item(), 4) for mode in AGG_MODES]
        [2.5, 10.0, 5.0, 3.0, 1.6667]
        >>> halves = [aggregate_loss(loss[i:i + 1], m[i:i + 1], num_tokens=4) for i in (0, 1)]
        >>> sum(halves).item()
        2.5
        >>> packed = aggregate_loss(loss[:1], m[:1], "seq-mean-token-mean",
        ...                         seq_ids=torch.tensor([[0, 0, 1]]), seqs_per_row=2)
        >>> packed.item()  # sequences [1, 2] and [3]: (1.5 + 3) / 2
        2.25
        >>> m2 = torch.tensor([[1, 1, 1], [0, 0, 0]])  # the second row has no action token
        >>> [aggregate_loss(loss, m2, "seq-mean-token-sum", empty_rows=e).item()
        ...  for e in ("skip", "count")]
        [6.0, 3.0]
    """
    check_2d("loss_mat", loss_mat)
    keep = as_bool_mask("mask", mask, loss_mat.shape, "loss_mat", loss_mat)
    agg = Aggregation.checked(
        "aggregate_loss", keep, loss_mat, mode, options, mode_name="mode", optional=False
    )
    return agg.reduce(agg.masked(loss_mat), agg.describe("aggregate_loss"))[0]
