"""SGLang's returned log-prob (``return_logprob``) as the keyword options of rlops' log-prob
ops."""

from __future__ import annotations

from rlops._checks import (
    as_int,
    as_real,
    check_bool,
    check_choice,
    check_nonneg,
    check_unit_interval,
)
from rlops.logprobs import LogprobOptions

RL_ON_POLICY_TARGETS = ("fsdp",)
"""SGLang's ``--rl-on-policy-target`` choices (``python/sglang/srt/server_args.py``)."""

# python/sglang/srt/sampling/sampling_params.py: 0 <= temperature < _SAMPLING_EPS is greedy,
# sampled as temperature 1 with top_k 1.
_SAMPLING_EPS = 1e-6


def logprob_options(
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
    return_original_logprob: bool = False,
    rl_on_policy_target: str | None = None,
) -> LogprobOptions:
    """The options of :func:`rlops.logprobs_and_entropy` (and the linear op) whose log-prob
    of the sampled token is SGLang's ``output_token_logprobs`` for a request with these
    sampling parameters and ``return_logprob=True`` (``python/sglang/srt/layers/sampler.py``,
    ``Sampler.forward``).

    SGLang samples from ``softmax(x / T)`` filtered by top-k, top-p and min-p, but returns
    the log-prob *before* the filters, never renormalised over the support:

    - by default ``log(softmax(x / T))``: the temperature applied, no filter (greedy
      batches: ``log_softmax(x)``, T counting as 1). ``--enable-deterministic-inference``
      computes the same value with ``log_softmax``;
    - ``return_original_logprob=True`` (the environment variable
      ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``): ``log_softmax(x)``, before the temperature;
    - ``rl_on_policy_target="fsdp"`` (``--rl-on-policy-target``):
      ``log_softmax(bf16(bf16(x) / T))``, the logits and ``x / T`` rounded to bfloat16, the
      result returned in bfloat16. With ``T = 1`` that is ``log_softmax`` of the bfloat16
      logits, which these options compute from them (float32 inside; the engine's value is
      that one rounded to bfloat16). With ``T != 1`` the rounding of ``x / T`` is not an
      option of rlops: ``NotImplementedError`` (pass ``(x.bfloat16() / T).bfloat16()`` as
      the logits with ``temperature=1``).

    ``top_k``, ``top_p`` and ``min_p`` are checked as SGLang checks them (``top_k`` -1
    or ``>= 1``; ``top_p`` in ``(0, 1]``; ``min_p`` in ``[0, 1]``,
    ``python/sglang/srt/sampling/sampling_params.py``) and do not enter the log-prob; a
    temperature below ``1e-6`` is greedy. The sampled token lies in the filters' support.

    Args:
      temperature, top_k, top_p, min_p: SGLang's sampling parameters.
      return_original_logprob: SGLang's ``SGLANG_RETURN_ORIGINAL_LOGPROB``.
      rl_on_policy_target: None or one of :data:`RL_ON_POLICY_TARGETS`.

    Returns:
      a dict with ``temperature``, ``top_k``, ``top_p`` and ``min_p`` (the filters None), to
      pass as ``**options``.

    Example:
        >>> from rlops.compat import sglang
        >>> sglang.logprob_options(temperature=0.7, top_p=0.9)
        {'temperature': 0.7, 'top_k': None, 'top_p': None, 'min_p': None}
    """
    t = check_nonneg("temperature", temperature)
    k = as_int("top_k", top_k, tensor=False)
    if k < 1 and k != -1:
        raise ValueError(f"top_k must be -1 (off) or >= 1, got {k}")
    p = as_real("top_p", top_p)
    if not 0.0 < p <= 1.0:  # also False for NaN
        raise ValueError(f"top_p must lie in (0, 1] (1: off), got {top_p}")
    check_unit_interval("min_p", as_real("min_p", min_p))
    original = check_bool("return_original_logprob", return_original_logprob)
    if rl_on_policy_target is not None:
        check_choice("rl_on_policy_target", rl_on_policy_target, RL_ON_POLICY_TARGETS)
    scaled = 1.0 if t < _SAMPLING_EPS or original else t
    if rl_on_policy_target is not None and scaled != 1.0:
        raise NotImplementedError(
            f"rl_on_policy_target={rl_on_policy_target!r} with temperature={t:g} rounds "
            "logits / temperature to bfloat16 before the log-softmax, which rlops' "
            "temperature does not: pass (logits.bfloat16() / temperature).bfloat16() as the "
            "logits with temperature=1.0"
        )
    return {"temperature": scaled, "top_k": None, "top_p": None, "min_p": None}
