"""Group-baseline advantage estimators: the import path ``rlops.group_advantages``, kept.

The family lives in :mod:`rlops.advantages` (``rlops.advantages.group``);
this module only re-exports it.
"""

from rlops.advantages.group import *  # noqa: F403
from rlops.advantages.group import __all__ as __all__
