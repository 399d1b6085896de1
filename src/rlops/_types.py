"""The types that many signatures share.

* :data:`Group`: a process-group argument, ``torch.distributed.ProcessGroup`` or ``None`` (one
  process, no collective). Every ``group=`` and ``cp_group=`` takes it; the value is checked at
  run time by :func:`rlops.distributed.groups.group_rank_size`.
* :data:`CPLayout`: a context-parallel layout name, ``"zigzag"`` or ``"contiguous"``
  (:mod:`rlops.distributed.layout`).
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import torch.distributed as dist

__all__ = ["CPLayout", "Group"]

#: ``torch.distributed.ProcessGroup | None``
Group: TypeAlias = "dist.ProcessGroup | None"

#: ``"zigzag" | "contiguous"``
CPLayout: TypeAlias = Literal["zigzag", "contiguous"]
