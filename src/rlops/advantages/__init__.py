"""Advantage and return estimators on the discounted reverse scan (:mod:`rlops.scan`).

Each estimator keeps its paths side by side: ``reference.py`` (the loop, the definition),
``compiled.py`` with ``_numba_kernels.py`` (fused single-pass CPU kernels), the chunked form
built from ``masking.py`` (the one statement of what ``mask`` and ``dones`` mean) in
``gae.py`` / ``reinforce.py``, and ``context_parallel.py`` (carry-only CP forms). Which one
runs is decided by one table per family (``gae.RETURNS``, ``reinforce.REINFORCE``, and the
scan's ``rlops.scan.SCAN``; :mod:`rlops.scan.dispatch`).
"""

from rlops.advantages.cumsum import discounted_cumsum
from rlops.advantages.gae import discounted_returns, gae
from rlops.advantages.reinforce import reinforce_plus_plus_returns

__all__ = ["discounted_cumsum", "discounted_returns", "gae", "reinforce_plus_plus_returns"]
