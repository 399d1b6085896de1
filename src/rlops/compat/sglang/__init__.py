"""SGLang's log-prob semantics, by name: the options of rlops' log-prob ops that compute what
an SGLang server returns as the sampled token's log-prob (docs/reference/compat-sglang.md)."""

from rlops.compat.sglang._logprobs import RL_ON_POLICY_TARGETS, logprob_options

__all__ = ["RL_ON_POLICY_TARGETS", "logprob_options"]
