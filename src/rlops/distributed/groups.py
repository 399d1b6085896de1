"""Process-group arguments: one check and one ``(rank, world size)`` for every function."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["group_rank_size"]


def group_rank_size(group: object, name: str = "group") -> tuple[int, int]:
    """``(rank, world_size)`` of this process in ``group``; ``(0, 1)`` for ``None`` (one process,
    no collective). Raises ``TypeError`` for anything but a ``ProcessGroup`` and ``ValueError``
    when torch.distributed is not initialised or this process is not a member. ``group`` is
    typed ``object``: this is the check every ``rlops._types.Group`` argument goes through, so
    it takes whatever a caller passed."""
    if group is None:
        return 0, 1
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(
            f"{name} must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    if not dist.is_initialized():
        raise ValueError(f"{name} was given but torch.distributed is not initialised")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process is not a member of {name}")
    return rank, dist.get_world_size(group)
