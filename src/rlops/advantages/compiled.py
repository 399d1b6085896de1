"""Fused single-pass CPU kernels for GAE, discounted returns and REINFORCE++ returns (numba,
the ``fast`` extra; the kernels are in :mod:`rlops.scan.tiles`).
"""

from __future__ import annotations

import functools

import torch

from rlops.advantages._masking import GaeInputs
from rlops.scan.compiled import (
    CARRIES_ONLY,
    as_input,
    header,
    kernels,
    launch,
    output,
    outputs,
    per_row,
)

__all__ = [
    "gae_compiled",
    "gae_kernel",
    "gae_plain",
    "reinforce_plain",
    "reinforce_returns_compiled",
]


def gae_compiled(x: GaeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused GAE in one pass (with ``values=None``, discounted returns), from a call in
    float32/64 or bfloat16 (read and written as it is, computed in float32; CPU): the carry
    decays by ``gamma_lam`` in float64, ``gamma`` enters the TD residual in the arithmetic
    dtype (each rounded once from the call's floats or tensors). Returns
    ``(advantages, returns)`` in the call's dtype.
    """
    values = None if x.values is None else x.values.contiguous()
    return gae_kernel(
        x.rewards.contiguous(), values, x.mask, x.dones, x.cut, x.end, x.gamma, x.gamma_lam
    )


def gae_kernel(
    rewards: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor | None,
    dones: torch.Tensor | None,
    cut: torch.Tensor | None,
    end: torch.Tensor | None,
    gamma: float | torch.Tensor,
    gamma_lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gae_compiled` on its fields (``rewards`` and ``values`` C-contiguous, as
    :class:`GaeInputs` holds them otherwise)."""
    tiles = kernels()
    wide = torch.float32 if rewards.dtype == torch.bfloat16 else rewards.dtype
    n, t_len = rewards.shape
    if values is None:
        adv = ret = output(rewards)
    else:
        adv, ret = outputs(rewards, 2)
    if n == 0 or t_len == 0:
        return adv, ret
    if end is None and isinstance(gamma, float) and isinstance(gamma_lam, float):
        init, g, gl = _float_params(gamma.hex(), gamma_lam.hex(), n, wide)  # (one lookup)
    else:
        init = per_row(0.0 if end is None else end, n, wide)
        g, gl = per_row(gamma, n, wide), per_row(gamma_lam, n, torch.float64)
    launch(
        tiles.gae,
        n,
        rewards,
        values,
        as_input(mask, torch.bool),
        as_input(dones, torch.bool),
        as_input(cut if dones is not None else None, wide),
        init,
        g,
        gl,
        None if values is None else adv,
        ret,
        lanes=tiles.WIDTH,
        tiles=t_len // tiles.TOKENS,
        carries=_carries_only(
            rewards.dtype, values is not None, mask is not None, dones is not None
        ),
    )
    return adv, ret


#: the plain calls' kept launches (gae_plain), by dtype, shape, mask, discounts and threads
_KEPT: dict = {}
_KEEP_AT_MOST = 64


def gae_plain(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    gamma: float,
    gamma_lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gae_kernel` on a plain call (:func:`rlops.gae`'s: float discounts in (0, 1],
    C-contiguous ``rewards`` and ``values``, no mask or a C-contiguous bool one): its launch
    made once per dtype, shape, mask or none, discounts and thread count (the kernel's
    per-row parameters kept with it, :func:`rlops.scan.compiled.header`) and run again on
    the call's arrays and new outputs: the same kernel on the same arrays, without the
    per-tensor reads and lookups of a launch."""
    n, t_len = rewards.shape
    key = (rewards.dtype, n, t_len, mask is None, gamma, gamma_lam, torch.get_num_threads())
    kept = _KEPT.get(key)
    if kept is None:
        return _keep(key, rewards, values, mask, gamma, gamma_lam)
    adv, ret = outputs(rewards, 2)
    if mask is None:
        kept[0].run((rewards.data_ptr(), values.data_ptr(), adv.data_ptr(), ret.data_ptr()))
    else:
        addresses = (rewards.data_ptr(), values.data_ptr(), mask.data_ptr())
        kept[0].run((*addresses, adv.data_ptr(), ret.data_ptr()))
    return adv, ret


def _keep(key: tuple, rewards, values, mask, gamma: float, gamma_lam: float):
    # gae_plain's first call of its kind
    tiles = kernels()
    n, t_len = rewards.shape
    if n == 0 or t_len == 0:
        return gae_kernel(rewards, values, mask, None, None, None, gamma, gamma_lam)
    wide = torch.float32 if rewards.dtype == torch.bfloat16 else rewards.dtype
    params = (per_row(0.0, n, wide), per_row(gamma, n, wide), per_row(gamma_lam, n, torch.float64))
    adv, ret = outputs(rewards, 2)
    carries = _carries_only(rewards.dtype, True, mask is not None, False)
    args = (rewards, values, mask, None, None, *params, adv, ret)
    _made(key, tiles.gae, n, args, (0, 1, 2, 8, 9), t_len, carries)
    return adv, ret


def _made(key: tuple, kernel, n: int, args: tuple, varying: tuple, t_len: int, carries: float):
    # A plain call's first of its kind: its launch made and run (rlops.scan.compiled.header),
    # kept where it is on the shares' compiled entry with the arguments that are not
    # ``varying`` (the kernel's per-row parameters: they live as long as the header holds
    # their addresses), else run on the numpy arrays (launch).
    tiles = kernels()
    shape = dict(lanes=tiles.WIDTH, tiles=t_len // tiles.TOKENS, carries=carries)
    made = header(kernel, n, *args, **shape, varying=varying)
    if made is None:
        launch(kernel, n, *args, **shape)
        return
    if len(_KEPT) >= _KEEP_AT_MOST:
        _KEPT.clear()
    _KEPT[key] = (made, [a for i, a in enumerate(args) if i not in varying])


@functools.lru_cache(maxsize=64)
def _float_params(gamma: str, gamma_lam: str, n: int, wide: torch.dtype) -> tuple:
    # the kernel's per-row start, gamma and gamma * lam (per_row's) for float discounts, keyed
    # by their exact text (as per_row keeps a float's tensor)
    g, gl = float.fromhex(gamma), float.fromhex(gamma_lam)
    return per_row(0.0, n, wide), per_row(g, n, wide), per_row(gl, n, torch.float64)


def _carries_only(dtype: torch.dtype, values: bool, mask: bool, dones: bool) -> float:
    # How a row split in time is cut (launch): a tile walked for its carries alone against
    # one written, as measured (8 x 131072, one thread; float32 GAE 0.54-0.56, bfloat16 GAE
    # without dones 0.39-0.46, its residuals made on token pairs; discounted returns
    # 0.43-0.48), then the fastest cut on two threads (0.3-0.7 swept: float32 GAE 0.5,
    # bfloat16 0.3-0.4; with right-padded masks 0.4 in both, the end piece's padding costing
    # little; the returns, CARRIES_ONLY, as discounted_cumsum's)
    if not values:
        return CARRIES_ONLY
    return 0.4 if (dtype == torch.bfloat16 or mask) and not dones else 0.5


def reinforce_returns_compiled(
    kl: torch.Tensor,
    outcome: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    gamma: float | torch.Tensor,
) -> torch.Tensor:
    """REINFORCE++ returns in one pass from ``kl`` ``[N, T]`` (float32/64, or bfloat16 computed
    in float32, CPU), ``outcome`` ``[N]``, ``mask`` bool and ``gamma`` (a float, ``[N]`` or
    ``[N, 1]``, no zero; the carry decays by it in float64); the token reward is rounded in
    ``kl``'s dtype (in bfloat16 also once more with the outcome added), as
    :func:`rlops.reinforce_plus_plus_returns` builds it.
    """
    tiles = kernels()
    kl = kl.contiguous()
    n, t_len = kl.shape
    ret = output(kl)
    if n == 0 or t_len == 0:
        return ret
    wide = torch.float32 if kl.dtype == torch.bfloat16 else kl.dtype
    launch(
        tiles.reinforce,
        n,
        kl,
        _outcome(outcome, kl.dtype, n, wide),
        per_row(-kl_coef, 1, wide),
        as_input(mask, torch.bool),
        per_row(gamma, n, torch.float64),
        ret,
        lanes=tiles.WIDTH,
        tiles=t_len // tiles.TOKENS,
        carries=_REINFORCE_CARRIES[kl.dtype == torch.bfloat16],
    )
    return ret


# a tile walked for its carries alone: 0.5 of one written in bfloat16, 0.55 in float32
# (8 x 131072, right-padded rows); the fastest cut on two threads at 0.5-0.55 in bfloat16,
# flat from 0.45 to 0.55 in float32 (0.4-0.6 swept): (float32/64, bfloat16)
_REINFORCE_CARRIES = (0.5, 0.55)


def _outcome(outcome: torch.Tensor, dtype: torch.dtype, n: int, wide: torch.dtype):
    # the kernel's [N] outcome: rounded in kl's dtype, in the arithmetic dtype
    if outcome.dtype != dtype:
        outcome = outcome.to(dtype)
    return per_row(outcome, n, wide)


def reinforce_plain(
    kl: torch.Tensor, outcome: torch.Tensor, mask: torch.Tensor, kl_coef: float, gamma: float
) -> torch.Tensor:
    """:func:`reinforce_returns_compiled` on a plain call (the plain lane of
    :func:`rlops.reinforce_plus_plus_returns`: float ``kl_coef`` and ``gamma``, C-contiguous
    ``kl`` and bool ``mask``, ``outcome`` of ``kl``'s dtype): its launch kept per dtype,
    shape, ``kl_coef``, ``gamma`` and thread count, as :func:`gae_plain`'s."""
    n, t_len = kl.shape
    key = ("reinforce", kl.dtype, n, t_len, kl_coef, gamma, torch.get_num_threads())
    kept = _KEPT.get(key)
    wide = torch.float32 if kl.dtype == torch.bfloat16 else kl.dtype
    ret = output(kl)
    if kept is not None:
        rewards = _outcome(outcome, kl.dtype, n, wide)
        kept[0].run((kl.data_ptr(), rewards.data_ptr(), mask.data_ptr(), ret.data_ptr()))
        return ret
    if n == 0 or t_len == 0:
        return ret
    rewards = _outcome(outcome, kl.dtype, n, wide)
    params = (per_row(-kl_coef, 1, wide), per_row(gamma, n, torch.float64))
    args = (kl, rewards, params[0], mask, params[1], ret)
    carries = _REINFORCE_CARRIES[kl.dtype == torch.bfloat16]
    _made(key, kernels().reinforce, n, args, (0, 1, 3, 5), t_len, carries)
    return ret
