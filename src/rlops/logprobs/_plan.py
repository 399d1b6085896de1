"""The frozen plan of one log-prob call on this rank's vocabulary shard: what the chunk loops
read. The preamble fixes the call; each pass binds its tensors with ``dataclasses.replace``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rlops._types import Group
from rlops.logprobs import _softmax, _support
from rlops.logprobs._softmax import Head
from rlops.logprobs._support import Sampler


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One call of a log-prob op, as this rank's chunk loops run it.

    Fixed for the call: ``rows`` (N tokens), this shard's ``v_local`` and first id ``start``,
    ``chunk``, the compute ``dtype``, the linear op's ``logits_dtype`` (None: its logits in the
    inputs' dtype), ``device``, the outputs' shape ``lead``, the head's map (a per-row
    ``temperature``: ``[N, 1]``), the flags, ``masked`` (the log-prob is over a support: two
    ``(m, s)`` in the statistics), the ``sampler``, ``group`` and ``world``. Bound per pass
    (None when not): the flat ``target`` ``[N]`` and ``keep`` ``[N, V_local]``; a row mask as
    ``rows_of`` (the valid rows, compacted; ``total`` rows in all) or ``row_valid`` ``[N]``
    bool (computed and zeroed); a CSR support as ``(support_rows, support_ids)`` pairs; the
    sampler's ``threshold`` ``[N, 1]``; in the backward the ``saved`` statistics and the
    upstream gradients.
    """

    rows: int
    v_local: int
    start: int = 0
    chunk: int
    dtype: torch.dtype
    logits_dtype: torch.dtype | None = None
    device: torch.device
    lead: tuple[int, ...] = ()
    temperature: float | torch.Tensor = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None
    with_entropy: bool = True
    entropy_grad: bool = True
    sum_pi_squared: bool = False
    masked: bool = False
    sampler: Sampler | None = None
    over_support: bool = False
    group: Group = None
    world: int = 1
    target: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    rows_of: torch.Tensor | None = None
    total: int = 0
    row_valid: torch.Tensor | None = None
    support_rows: torch.Tensor | None = None
    support_ids: torch.Tensor | None = None
    threshold: torch.Tensor | None = None
    saved: tuple[torch.Tensor, ...] = ()
    g_logp: torch.Tensor | None = None
    g_ent: torch.Tensor | None = None

    @property
    def inv_tau(self) -> float | torch.Tensor:
        return 1.0 / self.temperature

    @property
    def head(self) -> Head:
        """The map from this shard's logits to the scaled ``z`` (scale, softcap, temperature)."""
        return Head(self.temperature, self.logit_scale, self.softcap)

    @property
    def starts(self) -> range:
        """The first token of every chunk (one chunk when ``chunk`` is ``rows`` itself, as under
        ``torch.compile``: no range over a symbolic length, which would specialise it)."""
        if self.chunk is self.rows:
            return range(1)
        return range(0, self.rows, self.chunk)

    def bound(
        self,
        target: torch.Tensor,
        keep: torch.Tensor | None,
        rows: torch.Tensor | None = None,
        support: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Plan:
        """This plan with the op's ``target`` ``[...]`` and ``keep`` ``[..., V_local]`` bound,
        flattened to ``[N]`` and ``[N, V_local]`` (``keep`` stays indexed by the original rows).
        ``rows``: the row selection, int64 ``rows_of`` (the target compacted to those rows) or
        bool ``row_valid``; ``support``: ``(support_rows, support_ids)``."""
        flat = target.reshape(-1)
        rows_of = row_valid = None
        if rows is not None and rows.dtype == torch.bool:
            row_valid = rows
        elif rows is not None:
            rows_of, flat = rows, flat.index_select(0, rows)
        flat_keep = None if keep is None else keep.reshape(-1, self.v_local)
        s_rows, s_ids = (None, None) if support is None else support
        return replace(
            self, target=flat, keep=flat_keep, rows_of=rows_of, row_valid=row_valid,
            support_rows=s_rows, support_ids=s_ids,
        )  # fmt: skip

    def unbound(self) -> Plan:
        """This plan without its tensors (what the backward keeps beside the saved tensors)."""
        return replace(
            self, target=None, keep=None, sampler=None, threshold=None, rows_of=None,
            row_valid=None, support_rows=None, support_ids=None,
        )  # fmt: skip

    def tile(self, v0: int, v1: int) -> Plan:
        """The plan of this shard's vocabulary columns ``v0:v1`` (a tile's local gradient)."""
        keep = None if self.keep is None else self.keep[:, v0:v1]
        return replace(self, start=self.start + v0, v_local=v1 - v0, keep=keep)

    def target_index(self, i: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``i:j``: ``([C, 1]`` target column in the shard, ``[C, 1]`` bool: in it)."""
        if self.target is None:
            raise RuntimeError("the plan has no target bound")
        return _softmax.target_index(self.target[i:j], self.start, self.v_local)

    def keep_rows(self, i: int, j: int) -> torch.Tensor | None:
        """Tokens ``i:j`` of the keep mask ``[C, V_local]`` (from the CSR support: a chunk's
        own buffer), or None."""
        if self.support_rows is not None and self.support_ids is not None:
            return _support.chunk_keep(
                self.support_rows, self.support_ids, i, self.n_rows(i, j), self.start,
                self.v_local,
            )  # fmt: skip
        if self.keep is None:
            return None
        if self.rows_of is not None:
            return self.keep.index_select(0, self.rows_of[i:j])
        return self.keep[i:j]

    def n_rows(self, i: int, j: int) -> int:
        """How many of the rows ``i:j`` exist (``j`` may pass the end)."""
        if self.target is None:
            raise RuntimeError("the plan has no target bound")
        return self.target[i:j].shape[0]

    def compact(self, values: torch.Tensor) -> torch.Tensor:
        """``[total]`` per-row values (an upstream gradient) as the plan's ``[N]`` rows: the
        valid rows' values (0 on masked rows that are computed)."""
        flat = values.reshape(-1)
        if self.rows_of is not None:
            return flat.index_select(0, self.rows_of)
        if self.row_valid is not None:
            return torch.where(self.row_valid, flat, torch.zeros_like(flat))
        return flat

    def expand(self, values: torch.Tensor) -> torch.Tensor:
        """The plan's ``[N]`` per-row results as the op's ``[...]`` outputs: exact zeros on the
        masked rows."""
        if self.rows_of is not None:
            out = values.new_zeros(self.total)
            values = out.index_copy_(0, self.rows_of, values)
        elif self.row_valid is not None:
            values = torch.where(self.row_valid, values, torch.zeros_like(values))
        return values.view(self.lead)

    def zero_masked(self, grad: torch.Tensor, i: int) -> None:
        """Zero the rows of a computed chunk gradient ``grad`` (rows ``i:``) that the row mask
        drops (not compacted), so that they are exact zeros whatever their logits."""
        if self.row_valid is not None:
            valid = self.row_valid[i : i + grad.shape[0]]
            grad.masked_fill_(~valid.unsqueeze(1), 0.0)
