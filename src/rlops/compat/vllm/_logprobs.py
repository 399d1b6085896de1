"""vLLM's ``logprobs_mode`` as the keyword options of rlops' log-prob ops."""

from __future__ import annotations

from rlops._checks import as_int, as_real, check_choice, check_nonneg, check_unit_interval
from rlops.logprobs import LogprobOptions

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
"""vLLM's ``LogprobsMode`` (``vllm/config/model.py``)."""

# vllm/sampling_params.py: a temperature in (0, _MAX_TEMP) is raised to _MAX_TEMP; below
# _SAMPLING_EPS (then only 0) the request is greedy and its top_p / top_k / min_p are reset.
_MAX_TEMP = 1e-2
_SAMPLING_EPS = 1e-5


def logprob_options(
    logprobs_mode: str = "raw_logprobs",
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> LogprobOptions:
    """The options of :func:`rlops.logprobs_and_entropy` (and the linear op) whose log-prob
    of the sampled token is what vLLM returns under ``--logprobs-mode`` for a request with
    these ``SamplingParams`` (the V1 sampler, ``vllm/v1/sample/sampler.py``).

    - ``raw_logprobs`` (vLLM's default): ``log_softmax(x)`` of the model's logits (cast to
      float32), before any logits processor: no temperature, no filter.
    - ``processed_logprobs``: ``log_softmax(z)`` with ``z = x / T`` (``Sampler.apply_temperature``),
      then min-p (``MinPLogitsProcessor``, ``vllm/v1/sample/logits_processor/builtin.py``),
      then top-k and top-p (``apply_top_k_top_p``, ``vllm/v1/sample/ops/topk_topp_sampler.py``:
      top-p on the distribution renormalised over what top-k kept), the dropped logits set to
      ``-inf``: the log-prob renormalised over the sampler's support. rlops' sampler applies
      the filters in this order (docs/design/logprobs.md, Sampler support).
    - ``raw_logits`` / ``processed_logits``: vLLM returns the logit itself (raw, or ``z_y``
      after the filters), not a log-prob; the log-prob that follows is the log-softmax of
      those logits, the ``*_logprobs`` value, which these options compute. The two differ
      by the row's ``logsumexp``, which vLLM does not return (but for ``logprobs=-1``).

    vLLM's defaults and conventions: ``top_k`` 0 or -1, ``top_p = 1`` and ``min_p = 0`` are
    off; a temperature in ``(0, 0.01)`` is raised to 0.01; ``temperature = 0`` is greedy and
    its processed log-prob is ``log_softmax(x)`` (vLLM resets the filters, the temperature
    counts as 1). The processed modes assume no penalties, ``logit_bias``, ``bad_words``,
    ``allowed_token_ids`` or ``min_tokens``, which change the logits before the temperature.

    Args:
      logprobs_mode: one of :data:`LOGPROBS_MODES`.
      temperature: vLLM's ``temperature``, finite and ``>= 0``.
      top_k: ``-1``, ``0`` (off) or ``>= 1``.
      top_p: in ``(0, 1]``.
      min_p: in ``[0, 1]``.

    Returns:
      a dict with ``temperature``, ``top_k``, ``top_p`` and ``min_p`` (None where off), to
      pass as ``**options``.

    Example:
        >>> import torch, rlops
        >>> from rlops.compat import vllm
        >>> opts = vllm.logprob_options("processed_logprobs", temperature=0.5, top_k=1)
        >>> opts
        {'temperature': 0.5, 'top_k': 1, 'top_p': None, 'min_p': None}
        >>> rlops.logprobs_and_entropy(torch.tensor([[2.0, 0.0]]), torch.tensor([0]), **opts)[0]
        tensor([0.])
    """
    check_choice("logprobs_mode", logprobs_mode, LOGPROBS_MODES)
    t = check_nonneg("temperature", temperature)
    k = as_int("top_k", top_k, tensor=False)
    if k < -1:
        raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {k}")
    p = as_real("top_p", top_p)
    if not 0.0 < p <= 1.0:  # also False for NaN
        raise ValueError(f"top_p must lie in (0, 1] (1: off), got {top_p}")
    m = float(check_unit_interval("min_p", as_real("min_p", min_p)))
    if logprobs_mode.startswith("raw_") or t < _SAMPLING_EPS:
        return {"temperature": 1.0, "top_k": None, "top_p": None, "min_p": None}
    return {
        "temperature": max(t, _MAX_TEMP),
        "top_k": k if k >= 1 else None,
        "top_p": p if p < 1.0 else None,
        "min_p": m if m > 0.0 else None,
    }
