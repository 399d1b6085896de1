"""Whole-row (whole-sequence) sums and maxima of a ``[B, T]`` batch whose rows may be split over
a context-parallel group or packed with several sequences (``seq_ids``): each rank sums its own
tokens and one checked ``gather`` of ``[B, K, k]`` summaries completes them
(docs/design/context-parallel.md). From ``dones``, build ``seq_ids = dones.cumsum(-1) - dones``
on the whole row before sharding it.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.distributed as dist

from rlops._checks import as_int, check_choice, check_ids, values_checked
from rlops._types import EMPTY_ROWS, Group
from rlops.distributed.collectives import Call, gather
from rlops.distributed.groups import group_rank_size
from rlops.distributed.layout import check_cp_layout

__all__ = ["Rows"]


def _check_inside(group: Group, cp_group: Group) -> None:
    """``group`` (DP×CP) must hold every rank of ``cp_group`` (a DP-only group would count one CP
    rank's tokens only).
    """
    inner = set(dist.get_process_group_ranks(cast(dist.ProcessGroup, cp_group)))
    outer = set(dist.get_process_group_ranks(cast(dist.ProcessGroup, group)))
    if not inner <= outer:
        raise ValueError(
            "with cp_group, group must be the data-parallel × context-parallel group (every "
            "rank that holds a token of the batch, so it contains every rank of cp_group); got "
            f"a group of global ranks {sorted(outer)} and a cp_group of {sorted(inner)}"
        )


class Rows:
    """The rows of a ``[B, T]`` batch (or, with ``seq_ids``, its packed sequences) and their
    whole sums under context parallelism: every method returns ``[B, K]`` (``K`` = 1 without
    ``seq_ids``), one value per whole row, the same on every rank of ``cp_group``; one
    collective over ``cp_group`` completes all the sums of a call (and the action counts).

    Args:
        keep: ``[B, T]`` bool action mask (checked by the caller).
        dtype: the computation dtype of the returned values.
        cp_group: the context-parallel group whose ranks hold pieces of the same rows, or None.
        cp_layout: ``"zigzag"`` or ``"contiguous"`` (sums need no order: checked, compared).
        seq_ids: None, or ``[B, T]`` integer sequence ids of packed rows (mask-0 tokens' ids
            are ignored); action tokens' ids must lie in ``[0, seqs_per_row)`` (read where
            values are checked: on CPU, or with ``RLOPS_CHECK_VALUES=1``).
        seqs_per_row: the number of sequence slots ``K`` per row, with ``seq_ids``.
        group: the ``group=`` of the call (must contain ``cp_group``), or None.
        empty_rows: ``"skip"`` (rows without an action token are not sequences of the
            seq-mean modes) or ``"count"`` (every row is one); see :attr:`all_rows`.

    Example:
        >>> import torch
        >>> keep = torch.tensor([[True, True, False, True]])
        >>> rows = Rows(keep, torch.float32, seq_ids=torch.tensor([[0, 0, 0, 1]]), seqs_per_row=2)
        >>> rows.means(torch.tensor([[1.0, 3.0, 0.0, 5.0]]))[0]
        tensor([[2., 5.]])
        >>> rows.per_token(rows.count)
        tensor([[2., 2., 2., 1.]])
    """

    def __init__(
        self,
        keep: torch.Tensor,
        dtype: torch.dtype,
        *,
        cp_group: Group = None,
        cp_layout: object = "zigzag",
        seq_ids: object = None,
        seqs_per_row: object = None,
        group: Group = None,
        empty_rows: object = "skip",
    ) -> None:
        self.empty_rows = check_choice("empty_rows", empty_rows, EMPTY_ROWS)
        self.cp_rank, self.cp_world = group_rank_size(cp_group, "cp_group")
        self.layout = check_cp_layout(cp_layout)
        if self.cp_world > 1 and group is not None:
            group_rank_size(group)
            _check_inside(group, cp_group)
        self.keep, self.dtype, self.cp_group = keep, dtype, cp_group
        self.k = 1
        self.ids: torch.Tensor | None = None
        if seq_ids is None:
            if seqs_per_row is not None:
                raise ValueError("seqs_per_row is given without seq_ids (pass both, or neither)")
        else:
            ids = check_ids("seq_ids", seq_ids, keep.shape, "mask")
            if ids.device != keep.device:
                raise ValueError(f"seq_ids is on {ids.device} but mask is on {keep.device}")
            if seqs_per_row is None:
                raise ValueError(
                    "seq_ids needs seqs_per_row: the number of sequence slots per row (ids lie "
                    "in [0, seqs_per_row)), the same on every rank"
                )
            self.k = as_int("seqs_per_row", seqs_per_row, 1, tensor=False)
            ids = ids.to(torch.int64)
            if ids.device.type != "meta" and values_checked(ids):
                used = ids[keep]
                if used.numel() and (int(used.min()) < 0 or int(used.max()) >= self.k):
                    raise ValueError(
                        f"seq_ids of action tokens must lie in [0, seqs_per_row) = [0, {self.k})"
                        f", got values in [{int(used.min())}, {int(used.max())}]"
                    )
            self.ids = torch.where(keep, ids, 0)
            if self.empty_rows == "count":
                raise ValueError(
                    "empty_rows='count' counts whole rows, and with seq_ids the mask does not "
                    "say how many sequences a row holds: pass num_seqs (the number of "
                    "sequences of the global batch) instead"
                )
        self.call: Call | None = None
        self._count: torch.Tensor | None = None

    # ------------------------------------------------------------------ description
    @property
    def cp(self) -> bool:
        """Whether rows are split over more than one rank (collectives over ``cp_group``)."""
        return self.cp_world > 1

    @property
    def packed(self) -> bool:
        return self.ids is not None

    def fields(self) -> dict[str, object]:
        """What every rank must agree on, for a :class:`Call` (nothing without ``cp_group`` and
        ``seq_ids``: the call is then described as before)."""
        out: dict[str, object] = {}
        if self.cp_group is not None:
            out.update({"cp_group size": self.cp_world, "cp_layout": self.layout})
        if self.ids is not None:
            out["seqs_per_row"] = self.k
        if self.empty_rows != "skip":
            out["empty_rows"] = self.empty_rows
        return out

    # ------------------------------------------------------------------ local forms
    def local(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, K]``: this rank's sums of ``x`` (``[B, T]``, 0 off the mask) per row
        (sequence); differentiable."""
        if self.ids is None:
            return x.sum(-1, keepdim=True)
        return x.new_zeros(x.shape[0], self.k).scatter_add(-1, self.ids, x)

    def local_max(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, K]``: this rank's largest ``x`` over each row's action tokens; ``-inf`` for
        none."""
        x = torch.where(self.keep, x, -math.inf)
        if self.ids is None:
            if x.shape[-1] == 0:
                return x.new_full((x.shape[0], 1), -math.inf)
            return x.amax(-1, keepdim=True)
        out = x.new_full((x.shape[0], self.k), -math.inf)
        return out.scatter_reduce(-1, self.ids, x, "amax", include_self=True)

    def per_token(self, v: torch.Tensor) -> torch.Tensor:
        """``[B, K]`` per-row values to ``[B, T]``: every token gets its row's (sequence's)."""
        if self.ids is None:
            return v.expand(v.shape[0], self.keep.shape[-1])
        return v.gather(-1, self.ids)

    # ------------------------------------------------------------------ whole rows
    def reduce(
        self,
        sums: tuple[torch.Tensor, ...] = (),
        maxes: tuple[torch.Tensor, ...] = (),
        scalars: torch.Tensor | None = None,
        *,
        step: str = "row summaries",
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
        """Whole-row sums of ``sums`` and maxima of ``maxes`` (each ``[B, T]``, 0 off the mask;
        each returned ``[B, K]``, detached, in the computation dtype), and ``scalars`` (a 1-D
        tensor of this rank's totals) summed over ``cp_group`` — all in ONE collective, which
        also completes :attr:`count`. Without ``cp_group``: local, no collective (``scalars``
        returned as given)."""
        cols = [self.local(self.keep.to(self.dtype)), *(self.local(x.detach()) for x in sums)]
        mx = [self.local_max(x.detach()) for x in maxes]
        if self.cp:
            if self.call is None:
                raise RuntimeError("Rows.call must be set before a collective")
            table = torch.stack([*cols, *mx], -1).to(torch.float64)  # [B, K, k]
            n = table.shape[-1]
            if scalars is None:  # [B, k] (or [B, K, k] packed): the rows' own shape
                payload = table if self.packed else table.squeeze(1)
            else:
                payload = torch.cat([table.reshape(-1), scalars.detach().to(torch.float64)])
            call = self.call.with_fields(collective=step, columns=(len(cols), len(mx)))
            whole = gather(payload, self.cp_group, call, "cp_group").reshape(self.cp_world, -1)
            size = table.numel()
            table = whole[:, :size].reshape(self.cp_world, -1, self.k, n)
            cols = [c.to(self.dtype) for c in table[..., : len(cols)].sum(0).unbind(-1)]
            mx = [c.to(self.dtype) for c in table[..., len(cols) :].amax(0).unbind(-1)]
            if scalars is not None:
                scalars = whole[:, size:].sum(0)
        self._count = cols[0]
        return [c.detach() for c in cols[1:]], [m.detach() for m in mx], scalars

    def sums(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        """Whole-row sums of each ``x`` (``[B, T]``, 0 off the mask): ``[B, K]`` each, detached;
        one collective over ``cp_group`` for all of them."""
        return self.reduce(xs)[0]

    def means(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        """Whole-row means over the action tokens (0 for a row without one): ``[B, K]`` each,
        detached; one collective over ``cp_group`` for all of them."""
        got = self.sums(*xs)
        n = self.count.clamp_min(1)
        return [s / n for s in got]

    @property
    def known(self) -> bool:
        """Whether the whole-row counts are known without a collective."""
        return self._count is not None or not self.cp

    @property
    def count(self) -> torch.Tensor:
        """``[B, K]`` whole-row action counts (computation dtype); a collective over
        ``cp_group`` if no :meth:`reduce` completed them yet."""
        if self._count is None:
            if self.cp:
                self.reduce()
            else:
                self._count = self.local(self.keep.to(self.dtype))
        assert self._count is not None
        return self._count

    @property
    def nonempty(self) -> torch.Tensor:
        """``[B, K]`` bool: the rows (sequences) with an action token on some rank."""
        return self.count > 0

    @property
    def counted(self) -> torch.Tensor:
        """:attr:`nonempty` on CP rank 0, all False elsewhere: a row-level sum over a group of
        DP×CP ranks then counts every row once."""
        return self.nonempty if self.cp_rank == 0 else torch.zeros_like(self.nonempty)

    @property
    def all_rows(self) -> torch.Tensor:
        """The number of rows this rank counts for ``empty_rows="count"`` (float64, 0-dim):
        every row, on CP rank 0 only (summed over a DP×CP group, each row counts once)."""
        b = self.keep.shape[0] if self.cp_rank == 0 else 0
        return torch.full((), float(b), dtype=torch.float64, device=self.keep.device)
