"""The types that many signatures share.

* :data:`Group`: a process-group argument, ``torch.distributed.ProcessGroup`` or ``None`` (one
  process, no collective). Every ``group=`` and ``cp_group=`` takes it; the value is checked at
  run time by :func:`rlops.distributed.groups.group_rank_size`.
* :data:`CPLayout`: a context-parallel layout name, ``"zigzag"`` or ``"contiguous"``
  (:mod:`rlops.distributed.layout`).
* :data:`EmptyRows`: how rows without an action token count in the sequence means of a loss,
  ``"skip"`` or ``"count"`` (:func:`rlops.aggregate_loss`).
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import torch.distributed as dist

#: ``torch.distributed.ProcessGroup | None``
Group: TypeAlias = "dist.ProcessGroup | None"

#: ``"zigzag" | "contiguous"``
CPLayout: TypeAlias = Literal["zigzag", "contiguous"]

#: ``"skip" | "count"``
EmptyRows: TypeAlias = Literal["skip", "count"]

#: the values of :data:`EmptyRows`
EMPTY_ROWS = ("skip", "count")
