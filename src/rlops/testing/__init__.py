"""A numerics contract to run against a trainer's own log-prob, loss and advantage functions.

Three entry points, each taking the user's function and returning a :class:`Report` of named
checks against rlops' definitions (float64 references, compacted-sequence estimators, batch
splits)::

    from rlops.testing import check_advantages, check_logprobs, check_policy_loss

    check_logprobs(my_logprob_fn).raise_if_failed()
    assert check_policy_loss(my_loss_fn, agg="token-mean")
    print(check_advantages(my_gae_fn, estimator="gae"))

Deterministic (fixed seeds), torch only, each call a few seconds on a CPU at its defaults.
``docs/testing.md`` walks through the checks and what each one catches. Not part of
``rlops.__all__``: import it as ``rlops.testing``. Beside them, :func:`diagnose_mismatch`
says which semantics explain a rollout engine's log-probs (``docs/consistency.md``).
"""

from rlops.testing.advantages import ADVANTAGE_CHECKS, check_advantages
from rlops.testing.logprobs import LOGPROB_CHECKS, check_logprobs
from rlops.testing.losses import POLICY_LOSS_CHECKS, check_policy_loss
from rlops.testing.mismatch import MismatchReport, MismatchRow, diagnose_mismatch
from rlops.testing.report import Check, ContractError, Report

__all__ = [
    "ADVANTAGE_CHECKS",
    "LOGPROB_CHECKS",
    "POLICY_LOSS_CHECKS",
    "Check",
    "ContractError",
    "MismatchReport",
    "MismatchRow",
    "Report",
    "check_advantages",
    "check_logprobs",
    "check_policy_loss",
    "diagnose_mismatch",
]
