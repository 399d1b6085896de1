"""Distributed pieces: the context-parallel layouts (zigzag and contiguous), the process-group
check and the one collective of the small group reductions
(:mod:`rlops.distributed.collectives`).

The estimators take ``cp_group=`` directly (``rlops.gae(..., cp_group=g)``); this package
holds the layout helpers.
"""

from rlops.distributed import layout
from rlops.distributed.layout import *  # noqa: F403 (the layout helpers: layout.__all__)

__all__ = layout.__all__
