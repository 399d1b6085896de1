"""Distributed pieces: the zigzag context-parallel layout, the process-group check and the
one collective of the small group reductions (:mod:`rlops.distributed.collectives`).

The estimators take ``cp_group=`` directly (``rlops.gae(..., cp_group=g)``); this package
holds the layout helpers.
"""

from rlops.distributed.zigzag import (
    zigzag_indices,
    zigzag_response_mask,
    zigzag_shard,
    zigzag_shard_response,
    zigzag_unshard,
    zigzag_unshard_response,
)

__all__ = [
    "zigzag_indices",
    "zigzag_response_mask",
    "zigzag_shard",
    "zigzag_shard_response",
    "zigzag_unshard",
    "zigzag_unshard_response",
]
