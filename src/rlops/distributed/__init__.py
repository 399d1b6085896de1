"""Context-parallel layouts: which chunks of a sequence each rank holds, named by ``cp_layout=``
wherever a function takes ``cp_group=`` (``rlops.gae(..., cp_group=g)``).

* ``"zigzag"`` (Megatron's load-balanced layout): the sequence, padded to a multiple of
  ``2 * cp``, is cut into ``2 * cp`` equal chunks; rank ``r`` holds chunks ``r`` and
  ``2*cp - 1 - r``, in that order, so causal attention costs every rank the same.
* ``"contiguous"`` (slime's ``--allgather-cp``): the sequence, padded at its end to a multiple
  of ``cp``, is cut into ``cp`` equal chunks; rank ``r`` holds chunk ``r``.

``zigzag_*`` and ``contiguous_*`` are :func:`cp_indices`, :func:`cp_shard` and
:func:`cp_unshard` with the layout named. The package also holds, for the other packages, the
one checked collective of the group reductions (``collectives``) and whole-row sums of split
rows (``rows``): docs/design/group-calls.md, docs/design/context-parallel.md.
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
