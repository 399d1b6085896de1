"""Reward shaping applied to the scores before an estimator: DAPO's overlong penalty."""

from __future__ import annotations

import torch

from rlops._checks import as_int, check_nonneg, shape_error, values_checked

__all__ = ["overlong_penalty"]


def overlong_penalty(
    lengths: torch.Tensor, max_len: int, cache_len: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476), per response, to
    add to its score: 0 up to ``max_len − cache_len`` tokens, then falling linearly.

        P(L) = min(−(L − (max_len − cache_len)) / cache_len · factor, 0)

    As AReaL's ``reward_overlong_penalty`` (and verl's DAPO reward manager), the line goes on
    past ``max_len`` (``−factor`` at ``L = max_len``, lower beyond), where the paper stops at
    ``−1``; ``lengths`` are the responses' action tokens, AReaL's ``loss_mask.sum(-1)``, with
    ``max_len`` its ``max_new_tokens`` and ``cache_len`` its ``overlong_tokens``.

    Args:
        lengths: ``[B]`` response lengths ``>= 0``, integer or floating.
        max_len: the largest response length (``>= 1``).
        cache_len: the length of the punishment interval, ``1 <= cache_len <= max_len``.
        factor: ``>= 0``, the penalty at ``L = max_len``.

    Returns:
        ``[B]`` penalties ``<= 0``, in the dtype of floating ``lengths`` (else the default
        dtype).

    Example:
        >>> import torch
        >>> overlong_penalty(torch.tensor([10, 24, 28, 32, 36]), max_len=32, cache_len=8)
        tensor([ 0.0000,  0.0000, -0.5000, -1.0000, -1.5000])
    """
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"lengths must be a torch.Tensor, got {type(lengths).__name__}")
    if lengths.dtype == torch.bool or lengths.is_complex():
        raise TypeError(f"lengths must be an integer or floating tensor, got {lengths.dtype}")
    if lengths.dim() != 1:
        raise shape_error("lengths", "[B]", lengths.shape)
    max_len = as_int("max_len", max_len, 1)
    cache_len = as_int("cache_len", cache_len, 1)
    if cache_len > max_len:
        raise ValueError(f"cache_len must be <= max_len = {max_len}, got {cache_len}")
    factor = check_nonneg("factor", factor)
    if values_checked(lengths) and lengths.numel() > 0 and not bool((lengths >= 0).all()):
        raise ValueError("lengths must be >= 0 (and not NaN)")
    dtype = lengths.dtype if lengths.is_floating_point() else torch.get_default_dtype()
    wide = torch.float64 if lengths.device.type != "mps" else torch.float32
    exceed = lengths.to(wide) - (max_len - cache_len)
    return ((-exceed / cache_len * factor).clamp_max(0) + 0.0).to(dtype)  # + 0: no −0
