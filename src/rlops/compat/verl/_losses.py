"""verl's loss helpers (``verl/trainer/ppo/core_algos.py``)."""

from __future__ import annotations

import torch

import rlops
from rlops._checks import (
    as_bool_mask,
    as_int,
    check_2d,
    check_choice,
    check_count,
    check_positive,
    check_same_shape,
)
from rlops.compat.verl._config import response_mask as _response_mask
from rlops.losses import AGG_MODES, KL_KINDS


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty) -> torch.Tensor:
    """Per-token KL estimate (http://joschu.net/blog/kl-approx.html), verl's kinds (k3 at ±10).

    Example:
        >>> kl_penalty(torch.tensor([-1.0, -20.0]), torch.tensor([-1.5, -1.0]), "k3")
        tensor([ 0.1065, 10.0000])
    """
    kind = kl_penalty
    if kind == "full":
        raise NotImplementedError("kl_penalty 'full' needs the whole distribution")
    check_choice("kl_penalty", kind, KL_KINDS)
    check_same_shape("logprob", logprob, ref_logprob=ref_logprob)
    base = kind.rstrip("+")
    if base == "k3":  # verl's k3 is its low_var_kl (clamped at 10)
        kind = "low_var_kl" + kind[len(base) :]
    return rlops.kl_penalty(logprob, ref_logprob, kind)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> torch.Tensor:
    """A ``[bs, T]`` loss to a scalar by verl's ``loss_agg_mode`` and global normalisers.

    Example:
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> m = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> agg_loss(loss, m, "token-mean"), agg_loss(loss, m, "seq-mean-token-mean")
        (tensor(2.5000), tensor(3.))
    """
    check_2d("loss_mat", loss_mat)
    keep = as_bool_mask("loss_mask", loss_mask, loss_mat.shape, "loss_mat", loss_mat)
    check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
    dp_size = as_int("dp_size", dp_size, minimum=1)
    if loss_scale_factor is not None:
        loss_scale_factor = check_positive("loss_scale_factor", loss_scale_factor)
    # a number or a 0-dim tensor, kept as given (a device tensor is not read back)
    batch_num_tokens = check_count("batch_num_tokens", batch_num_tokens)
    global_batch_size = check_count("global_batch_size", global_batch_size)
    if dp_size > 1:  # as verl: the global count of the mode's normaliser must be given
        if loss_agg_mode == "token-mean" and batch_num_tokens is None:
            raise ValueError("batch_num_tokens is required when dp_size > 1")
        if loss_agg_mode.startswith("seq-mean") and global_batch_size is None:
            raise ValueError("global_batch_size is required when dp_size > 1")
    share = rlops.aggregate_loss(
        loss_mat,
        keep,
        loss_agg_mode,
        loss_scale_factor=loss_scale_factor,
        num_tokens=batch_num_tokens,
        num_seqs=global_batch_size,
    )
    # rlops' shares sum to the global loss over ranks; verl's DDP/FSDP average over them
    return share * dp_size


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """Clipped value loss ``0.5·agg(max((V − R)², (V_clip − R)²))``: ``(vf_loss, vf_clipfrac)``.

    Example:
        >>> vf_loss, frac = compute_value_loss(torch.tensor([[1.0, 3.0]]), torch.zeros(1, 2),
        ...                                    torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), 0.5)
        >>> vf_loss, frac
        (tensor(2.5000), tensor(0.))
    """
    check_2d("vpreds", vpreds)
    check_same_shape("vpreds", vpreds, returns=returns, values=values)
    mask = _response_mask(response_mask, "vpreds", vpreds)
    clip = check_positive("cliprange_value", cliprange_value)
    check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
    half_mat, metrics = rlops.value_loss(vpreds, values, returns, mask, clip=clip, agg=None)
    loss = agg_loss(
        half_mat,
        mask,
        loss_agg_mode,
        dp_size,
        batch_num_tokens,
        global_batch_size,
        loss_scale_factor,
    )
    return loss, metrics["vf_clipfrac"]
