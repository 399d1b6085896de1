"""vLLM's log-prob semantics, by name: the options of rlops' log-prob ops that compute what a
vLLM engine returns as the sampled token's log-prob (docs/reference/compat-vllm.md)."""

from rlops.compat.vllm._logprobs import LOGPROBS_MODES, logprob_options

__all__ = ["LOGPROBS_MODES", "logprob_options"]
