"""Distributed pieces: the context-parallel layouts (zigzag and contiguous), the process-group
check and the one collective of the small group reductions
(:mod:`rlops.distributed.collectives`).

The estimators take ``cp_group=`` directly (``rlops.gae(..., cp_group=g)``); this package
holds the layout helpers.
"""

from rlops.distributed import layout
from rlops.distributed.layout import *  # noqa: F403 (the layout helpers: layout.__all__)

__all__ = layout.__all__

#: slime's response-layout helpers, which moved to :mod:`rlops.compat.slime`
_MOVED = ("zigzag_response_mask", "zigzag_shard_response", "zigzag_unshard_response")


def __getattr__(name: str) -> object:
    if name in _MOVED:
        raise AttributeError(
            f"rlops.distributed.{name} moved to rlops.compat.slime.{name} "
            "(slime's response layout): import it from there"
        )
    raise AttributeError(f"module 'rlops.distributed' has no attribute {name!r}")
