"""Log-probabilities and entropy of the policy's softmax, fused, chunked and vocabulary-parallel.

- :func:`logprobs_and_entropy`: from logits ``[..., V_local]``.
- :func:`linear_logprobs_and_entropy`: from hidden states and the output layer's weight, without
  ever building the logits.
- :func:`copy_to_tensor_parallel_region`: the input op of a vocabulary-parallel output layer
  (identity forward, gradient all-reduce backward).

The unfused reference lives in :mod:`rlops.logprobs.reference`.
"""

from rlops.logprobs._options import LogprobOptions
from rlops.logprobs.fused import logprobs_and_entropy
from rlops.logprobs.linear import copy_to_tensor_parallel_region, linear_logprobs_and_entropy

__all__ = [
    "LogprobOptions",
    "copy_to_tensor_parallel_region",
    "linear_logprobs_and_entropy",
    "logprobs_and_entropy",
]
