"""verl's top-k distillation loss (``verl/trainer/distillation/fsdp/losses.py``) on
:func:`rlops.distillation_loss`: the student's top-k log-probs without ``[B, T, V]``."""

from __future__ import annotations

from typing import cast

import torch

import rlops
from rlops.compat.verl._config import config_value

_FORMATS = ("thd", "bshd")


def _packed(name: str, t: object) -> torch.Tensor:
    """A jagged nested tensor's values as ``(1, total_nnz, k)`` (verl's packing); a plain
    tensor is taken as it is."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (nested, as verl passes it)")
    return t.values().unsqueeze(0) if t.is_nested else t


def compute_forward_kl_topk(
    student_logits: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    config: object,
    data_format: str,
) -> dict[str, torch.Tensor]:
    """Forward KL over the teacher's top-k: ``Σ_K p_t (log p_t − log p_s)`` per token.

    ``config.distillation_loss.log_prob_min_clamp`` clamps both top-k log-probs (verl's
    ``clamp_min``); the masses are unclamped; the overlap diagnostics count the teacher's ids
    among the student's top-k (arXiv:2604.13016). Differences from verl: no ``[B, T, V]``
    ``log_softmax`` and the student's log-probs stay in float32 for half logits (verl rounds
    them to the logits' dtype first); no Ulysses slicing (pass this rank's tokens).

    Args:
        student_logits: ``(1, total_nnz, V)`` (or ``(B, T, V)`` with plain teacher tensors).
        teacher_topk_log_probs: jagged nested ``(bsz, j, k)``, or ``student_logits.shape[:2]
            + (k,)``.
        teacher_topk_ids: the same layout, int ids.
        config: verl's ``DistillationConfig`` (``config.distillation_loss``).
        data_format: ``"thd"`` or ``"bshd"``.

    Returns:
        A dict with ``distillation_losses``, ``student_mass``, ``teacher_mass``,
        ``overlap_count`` and ``overlap_token_advantage``, each ``student_logits.shape[:2]``.

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=None))
        >>> out = compute_forward_kl_topk(
        ...     torch.tensor([[[2.0, 1.0, 0.0]]]), torch.tensor([[[-0.5]]]),
        ...     torch.tensor([[[1]]]), cfg, "thd")
        >>> round(float(out["distillation_losses"]), 4)
        0.5505
    """
    if data_format not in _FORMATS:
        raise ValueError(f"data_format must be one of {list(_FORMATS)}, got {data_format!r}")
    logp = _packed("teacher_topk_log_probs", teacher_topk_log_probs)
    ids = _packed("teacher_topk_ids", teacher_topk_ids)
    clamp = config_value(config_value(config, "distillation_loss"), "log_prob_min_clamp")
    loss, m = rlops.distillation_loss(
        student_logits, logp, ids, log_prob_min_clamp=cast(float | None, clamp)
    )
    ota = torch.promote_types(logp.dtype, student_logits.dtype)
    return {
        "distillation_losses": loss.float(),
        "student_mass": m["student_mass"].to(student_logits.dtype),
        "teacher_mass": m["teacher_mass"].to(logp.dtype),
        "overlap_count": m["overlap_count"],
        "overlap_token_advantage": m["overlap_token_advantage"].to(ota),
    }
