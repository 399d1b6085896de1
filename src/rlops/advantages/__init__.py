"""Advantage and return estimators: GAE, discounted returns, REINFORCE++ returns and
``discounted_cumsum`` on the reverse scan, their methods side by side (``reference``,
``compiled``, ``triton``, ``context_parallel``) under one dispatch table per family; and the
group-baseline estimators (``group``)."""

from rlops.advantages import group
from rlops.advantages.cumsum import discounted_cumsum
from rlops.advantages.group import *  # noqa: F403 (the group-baseline estimators: group.__all__)
from rlops.advantages.reinforce import reinforce_plus_plus_returns
from rlops.advantages.returns import discounted_returns, gae

__all__ = ["discounted_cumsum", "discounted_returns", "gae", "reinforce_plus_plus_returns"]
__all__ += group.__all__
