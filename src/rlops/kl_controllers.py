"""verl's KL-coefficient controllers: the import path ``rlops.kl_controllers``, kept.

The family lives in :mod:`rlops.losses` (``rlops.losses.kl_controllers``);
this module only re-exports it.
"""

from rlops.losses.kl_controllers import *  # noqa: F403
from rlops.losses.kl_controllers import __all__ as __all__
