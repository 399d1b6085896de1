"""rlops: the numerical core of reinforcement learning on language models.

Advantages and returns (one discounted reverse scan), log-probs and entropy, losses, and the
distributed pieces they need, as pure functions on ``[B, T]`` tensors.
"""

from rlops.advantages import discounted_returns, gae, reinforce_plus_plus_returns
from rlops.scan import discounted_cumsum

__version__ = "0.1.0"

__all__ = [
    "discounted_cumsum",
    "discounted_returns",
    "gae",
    "reinforce_plus_plus_returns",
]
