"""Distributed pieces: the context-parallel layouts (zigzag and contiguous), the process-group
check and the one collective of the small group reductions
(:mod:`rlops.distributed.collectives`).

The estimators take ``cp_group=`` directly (``rlops.gae(..., cp_group=g)``); this package
holds the layout helpers.
"""

from rlops.distributed.layout import (
    CP_LAYOUTS,
    contiguous_indices,
    contiguous_shard,
    contiguous_unshard,
    cp_indices,
    cp_shard,
    cp_unshard,
    zigzag_indices,
    zigzag_shard,
    zigzag_unshard,
)

__all__ = [
    "CP_LAYOUTS",
    "contiguous_indices",
    "contiguous_shard",
    "contiguous_unshard",
    "cp_indices",
    "cp_shard",
    "cp_unshard",
    "zigzag_indices",
    "zigzag_shard",
    "zigzag_unshard",
]
