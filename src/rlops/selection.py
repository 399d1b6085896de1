"""Selection masks (OPSM, M2PO, top-entropy, behaviour weights):
the import path ``rlops.selection``, kept.

The family lives in :mod:`rlops.corrections` (``rlops.corrections.selection``);
this module only re-exports it.
"""

from rlops.corrections.selection import *  # noqa: F403
from rlops.corrections.selection import __all__ as __all__
