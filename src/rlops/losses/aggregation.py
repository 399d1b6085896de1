"""Aggregation of a per-token loss matrix into a scalar (layout-invariant, context-parallel
and packed rows: docs/design/losses.md)."""

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
    """The keywords every loss passes to its aggregation, each optional (docs/design/losses.md).

    Attributes:
        loss_scale_factor: ``L > 0`` of ``seq-mean-token-sum-norm`` (None: ``T``).
        num_tokens: the global batch's action tokens (``token-mean``), a number or 0-dim tensor.
        num_seqs: the global batch's rows with an action token, for the seq-mean modes.
        group: the data-parallel group, one micro-batch per rank (DP×CP with ``cp_group``).
        cp_group: the context-parallel group whose ranks hold pieces of the same rows.
        cp_layout: ``"zigzag"`` (the default) or ``"contiguous"``.
        seq_ids: ``[B, T]`` integer ids of packed sequences, in ``[0, seqs_per_row)``.
        seqs_per_row: with ``seq_ids``, the sequence slots per row (an int).
        empty_rows: ``"skip"`` (the default) or ``"count"`` rows without an action token in S.
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
    """A loss call's checked aggregation: mode, normalisers, ``group`` and :class:`Rows`; made by
    :meth:`checked`, then :meth:`describe` and :meth:`reduce`."""

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
        """Check ``mode`` and the :class:`AggregationOptions` of a call of ``fn``."""
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
        """The :class:`Call` the ranks of a group must agree on (also set as ``rows.call``)."""
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
        """``x`` in the computation dtype, 0 off the action tokens."""
        return torch.where(self.rows.keep, x.to(self.dtype), 0)

    def reduce(
        self,
        loss_mat: torch.Tensor,
        call: Call,
        metric_sums: dict[str, tuple[torch.Tensor, str]] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:func:`loss_and_metrics` of ``loss_mat`` (0 off the action tokens)."""
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
    """Whether ``mode`` needs whole-row counts (``n_b``, or ``S`` unless ``num_seqs`` gives it)."""
    return mode == "seq-mean-token-mean" or (mode in _SEQ_MODES and num_seqs is None)


def _given(
    keep: torch.Tensor,
    mode: str | None,
    dtype: torch.dtype,
    num_tokens: float | torch.Tensor | None,
    num_seqs: float | torch.Tensor | None,
) -> float | torch.Tensor | None:
    """The given count of ``mode`` (a number or a device tensor), else None; 0 becomes 1
    without action tokens, a ``ValueError`` with them where values are read (design notes)."""
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
    """``mode`` reduction of ``x`` (0 off the mask) by ``denom`` (None: this call's count)."""
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
    """``agg`` of ``loss_mat`` and the metrics (``metric_sums``: name -> ``(sum, "tokens" or
    "rows")``), divided by the whole counts; collectives: docs/design/losses.md."""
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
    """Reduce a per-token loss ``[B, T]`` to a scalar with verl's ``loss_agg_mode`` names; ``m`` the
    mask, ``n_b = Σ_t m[b,t]``, ``N`` the action tokens, ``S`` the rows with ``n_b > 0``::

        token-mean               Σ_{b,t} m·ℓ / N
        token-sum                Σ_{b,t} m·ℓ
        seq-mean-token-sum       (1/S) Σ_b Σ_t m·ℓ
        seq-mean-token-mean      (1/S) Σ_b (Σ_t m·ℓ) / n_b
        seq-mean-token-sum-norm  (1/S) Σ_b Σ_t m·ℓ / L      (L = loss_scale_factor or T)

    With the global ``num_tokens`` / ``num_seqs`` (or ``group=``) the micro-batches' losses and
    gradients **sum** to the full batch's (docs/design/losses.md; Dr.GRPO's norm mode:
    https://arxiv.org/abs/2503.20783).

    Args:
        loss_mat, mask: ``[B, T]`` per-token loss and 0/1 action mask.
        mode: one of :data:`AGG_MODES`.
        **options: :class:`AggregationOptions`; another keyword is a ``TypeError``.

    Returns:
        0-dim tensor, float32 for half inputs, else ``loss_mat``'s dtype. Differentiable.

    Example:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> m = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> [round(aggregate_loss(loss, m, mode).item(), 4) for mode in AGG_MODES]
        [2.5, 10.0, 5.0, 3.0, 1.6667]
    """
    check_2d("loss_mat", loss_mat)
    keep = as_bool_mask("mask", mask, loss_mat.shape, "loss_mat", loss_mat)
    agg = Aggregation.checked(
        "aggregate_loss", keep, loss_mat, mode, options, mode_name="mode", optional=False
    )
    return agg.reduce(agg.masked(loss_mat), agg.describe("aggregate_loss"))[0]
