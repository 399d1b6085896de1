"""TRL's fused LM head (``trl/trainer/utils.py``) served by rlops; TRL imported in :func:`patch`."""

from __future__ import annotations

from typing import Any

import torch

import rlops
from rlops._checks import check_logit_scale, check_softcap


def head_options(text_config: Any) -> tuple[dict[str, Any], str]:
    """A text config's logit scale and final softcap as TRL's fused head reads them."""
    name = "logit_scale"
    scale = getattr(text_config, "logit_scale", None)
    for alt in ("output_multiplier", "lm_head_multiplier"):
        if scale is None:
            name, scale = alt, getattr(text_config, alt, None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        name, scaling = "logits_scaling", text_config.logits_scaling
        hyperclovax = getattr(text_config, "model_type", None) == "hyperclovax"
        scale = scaling if hyperclovax else 1 / scaling
    if scale is None:
        name, scale = "logit_scale", 1.0
    softcap = getattr(text_config, "final_logit_softcapping", None)
    return {"logit_scale": scale, "final_logit_softcapping": softcap}, name


class RlopsChunkedLogProb:
    """Stands for TRL's ``ChunkedLogProbFunction``, by rlops's linear op."""

    original: Any = None

    @classmethod
    def apply(cls, *args, **kwargs):
        """TRL's call, served by :func:`_linear_head` or passed on to TRL's function."""
        served = _linear_head(*args, **kwargs)
        return cls.original.apply(*args, **kwargs) if served is None else served


def _linear_head(
    hidden,
    weight,
    bias,
    targets,
    temperature,
    chunk_size,
    final_logit_softcapping=None,
    logit_scale=1.0,
    outputs=("log_probs",),
):
    """TRL's head outputs by rlops's linear op, or None where it does not serve them."""
    try:
        check_logit_scale(logit_scale)
        check_softcap(final_logit_softcapping)
        served = set(outputs) <= {"log_probs", "entropy"}
    except (TypeError, ValueError):
        served = False
    if not served:
        return None
    # TRL's float32 head (cast_lm_head_to_fp32: float32 hidden states, autocast off) on a half
    # weight: float32 logits from the weight as it is, never a float32 copy of it
    wide = (
        hidden.dtype == torch.float32
        and weight.dtype in (torch.float16, torch.bfloat16)
        and not torch.is_autocast_enabled(hidden.device.type)
    )
    hidden = hidden.to(weight.dtype)  # autocast: the head in the weight's dtype
    lp, ent = rlops.linear_logprobs_and_entropy(
        hidden,
        weight,
        targets,
        bias=None if bias is None else bias.to(weight.dtype),
        temperature=temperature,
        logit_scale=logit_scale,
        final_logit_softcapping=final_logit_softcapping,
        with_entropy="entropy" in outputs,
        logits_dtype=torch.float32 if wide else None,
    )
    return lp, ent, None, None, None


def patch(enabled: bool = True) -> None:
    """Serve TRL's fused LM head (``add_fused_lm_head``: GRPO, RLOO, DPO, KTO, SFT) by
    :func:`rlops.linear_logprobs_and_entropy` for the process; ``patch(False)`` puts TRL's back.

    Example (not run here: it needs TRL)::

        from rlops.compat import trl as rlops_trl

        rlops_trl.patch()
    """
    from trl.trainer import utils

    if RlopsChunkedLogProb.original is None:
        RlopsChunkedLogProb.original = utils._ChunkedLogProbFunction
    head = RlopsChunkedLogProb if enabled else RlopsChunkedLogProb.original
    setattr(utils, "_ChunkedLogProbFunction", head)  # noqa: B010  (a module global of TRL's)
