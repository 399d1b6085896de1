"""REINFORCE++ token returns and their dispatch table :data:`REINFORCE`: one fused numba or
Triton kernel from the KL (full precision; numba also in bfloat16), else the token rewards
handed to :func:`rlops.discounted_returns`; under ``cp_group=`` the carry-only form.
"""

from __future__ import annotations

import dataclasses

import torch

import rlops.scan as scan
from rlops._checks import (
    as_bool_mask,
    as_dtype,
    as_float_tensor,
    check_2d,
    check_nonneg,
    check_same_device,
    compute_dtype,
    per_row_discount,
    shape_error,
)
from rlops._types import CPLayout, Group
from rlops.advantages import compiled
from rlops.advantages._masking import as_rows
from rlops.advantages.returns import PLAIN_DTYPES, context_parallel_row, discounted_returns
from rlops.distributed.collectives import fails_together
from rlops.distributed.layout import check_cp_layout

__all__ = ["REINFORCE", "reinforce_plus_plus_returns"]


@dataclasses.dataclass(slots=True)
class Call:
    """One checked call: ``kl`` ``[B, T]`` and ``outcome`` ``[B]`` in the promoted dtype, ``mask``
    bool, ``gamma`` a float or ``[B, 1]`` as given.
    Made once per call and not changed after (not a frozen dataclass: its ``__init__`` costs
    microseconds more when the caches are cold).
    """

    kl: torch.Tensor
    outcome: torch.Tensor
    mask: torch.Tensor
    kl_coef: float
    gamma: float | torch.Tensor
    cp_group: Group = None
    cp_layout: CPLayout = "zigzag"

    def token_rewards(self) -> torch.Tensor:
        return torch.where(self.mask, -self.kl_coef * self.kl, 0.0)


def _fused(method: str, c: Call) -> torch.Tensor:
    # one pass from the KL: the token rewards are never written (the same values as _two_step)
    return compiled.reinforce_returns_compiled(c.kl, c.outcome, c.mask, c.kl_coef, c.gamma)


def _fused_triton(method: str, c: Call) -> torch.Tensor:
    from rlops.advantages.triton import reinforce_returns_triton  # imported on first use only

    # one kernel from the KL; the token reward rounded in the input dtype, as _two_step's
    rows = as_rows(c.gamma, c.kl.shape[0], torch.float64, c.kl.device)
    return reinforce_returns_triton(c.kl, c.outcome, c.mask, c.kl_coef, rows)


def _two_step(method: str, c: Call) -> torch.Tensor:
    token_rewards = c.token_rewards()
    t_len = token_rewards.shape[1]
    if t_len > 0:
        # the last action token of each row: T-1 - (first action index in the flipped row)
        last = (t_len - 1) - c.mask.flip(-1).to(torch.uint8).argmax(-1, keepdim=True)
        outcome = torch.where(c.mask.any(-1), c.outcome, 0.0).unsqueeze(-1)
        token_rewards.scatter_add_(1, last, outcome)  # a new tensor: written in place
    return discounted_returns(token_rewards, gamma=c.gamma, mask=c.mask, method=method)


def _context_parallel(method: str, c: Call) -> torch.Tensor:
    from rlops.advantages.context_parallel import Layout, cp_reinforce_returns

    layout = Layout(c.cp_group, c.cp_layout)
    cdt = compute_dtype(c.kl.dtype)
    rows = as_rows(c.gamma, c.kl.shape[0], cdt, c.kl.device)
    out = cp_reinforce_returns(
        c.token_rewards().to(cdt), c.outcome.to(cdt), c.mask, rows, layout, method, c.kl_coef
    )
    return out.to(c.kl.dtype)


def _full_precision(case: scan.Case) -> bool:
    # the fused kernels round the token reward in the input dtype and carry the outcome
    # unrounded; in half precision the two-step form rounds their sum first
    return compute_dtype(case.dtype) == case.dtype


def _fusable(case: scan.Case) -> bool:
    # the numba kernel also multiplies its carries (no exact cut at a zero discount); in
    # bfloat16 it rounds the token reward, then its sum with the outcome, as the two-step form
    bf16 = case.dtype == torch.bfloat16
    return (_full_precision(case) or bf16) and not case.zero_discount()


_FUSED = scan.Row((scan.COMPILED,), _fused, when=_fusable)

# REINFORCE++ returns: (method, device, grad, dtype, CP) -> implementation
REINFORCE = scan.Table(
    "reinforce_plus_plus_returns",
    [
        context_parallel_row(_context_parallel),
        _FUSED,
        scan.Row((scan.TRITON_FORWARD,), _fused_triton, when=_full_precision),
        scan.Row((scan.REFERENCE, scan.CHUNKED, scan.COMPILED, scan.TRITON_FORWARD), _two_step),
    ],
)


@fails_together("RLOPS_CP_CHECK")
def reinforce_plus_plus_returns(
    rewards: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    gamma: float | torch.Tensor,
    method: str = "auto",
    cp_group: Group = None,
    cp_layout: CPLayout = "zigzag",
) -> torch.Tensor:
    """REINFORCE++ token returns (Hu, 2025, https://arxiv.org/abs/2501.03262).

    The token reward is ``-kl_coef * kl[t]`` on action tokens, plus the outcome score
    ``rewards[b]`` on the row's last action token; the returns are the discounted returns of
    that reward over action tokens, with mask-0 tokens (tool output, observations) *skipped*:
    the outcome reaches every earlier action, discounted once per action step.

    Args:
        rewards: ``[B]`` outcome scores (floating).
        kl: ``[B, T]`` per-token KL estimates (e.g. from :func:`rlops.kl_penalty`).
        mask: ``[B, T]`` bool or 0/1, 1 = action token. A row with no action token gives 0s.
        kl_coef: the KL coefficient (>= 0).
        gamma: a float in [0, 1] or a per-row tensor ``[B]``.
        method: as in :func:`discounted_returns`.
        cp_group: a context-parallel process group; ``kl``, ``mask`` and the output are this
            rank's shards, ``rewards`` is ``[B]`` on every rank. The outcome lands on the
            globally last action token, found from the exchanged carries (one collective).
        cp_layout: the shards' layout, ``"zigzag"`` or ``"contiguous"``, as in :func:`rlops.gae`.

    Returns:
        ``[B, T]`` returns in the promoted dtype of ``rewards`` and ``kl``, 0 on mask-0 tokens.

    Example:
        >>> import torch, rlops
        >>> kl = torch.zeros(1, 4)
        >>> m = torch.tensor([[1, 0, 1, 0]])
        >>> rlops.reinforce_plus_plus_returns(torch.tensor([1.0]), kl, m, kl_coef=0.1, gamma=0.5)
        tensor([[0.5000, 0.0000, 1.0000, 0.0000]])
    """
    if (
        method == "auto"
        and cp_group is None
        and cp_layout == "zigzag"
        and type(kl_coef) is float
        and type(gamma) is float
    ):
        plain = _plain(rewards, kl, mask, kl_coef, gamma)
        if plain is not None:
            return plain
    kl = check_2d("kl", kl)
    rewards = as_float_tensor("rewards", rewards)
    mask = as_bool_mask("mask", mask, kl.shape, "kl", ref=kl)
    b = kl.shape[0]
    if tuple(rewards.shape) != (b,):
        raise shape_error("rewards", f"[B] = [{b}] (one outcome score per row)", rewards.shape)
    check_same_device("kl", kl, rewards=rewards)
    kl_coef = check_nonneg("kl_coef", kl_coef)
    check_cp_layout(cp_layout)
    gamma_ = per_row_discount("gamma", gamma, b, kl)
    dtype = kl.dtype  # (promote_types is a dispatch: microseconds, caches cold)
    if rewards.dtype != dtype:
        dtype = torch.promote_types(rewards.dtype, dtype)
    cp = cp_group is not None
    case = scan.case_of(kl, rewards, gamma_, dtype=dtype, cp=cp, discounts=(gamma_,))
    kl, rewards = as_dtype(kl, dtype), as_dtype(rewards, dtype)
    call = Call(kl, rewards, mask, kl_coef, gamma_, cp_group, cp_layout)
    return REINFORCE(method, case, call)


def _plain(rewards: object, kl: object, mask: object, kl_coef: float, gamma: float):
    """The plain call where auto runs the fused kernel on it (as :func:`rlops.gae`'s): a
    finite ``kl_coef >= 0`` and ``gamma`` in (0, 1] as floats, ``kl`` ``[B, T]`` and
    ``rewards`` ``[B]`` CPU tensors of one dtype (float32, float64 or bfloat16) that need no
    gradient, ``mask`` a bool tensor of ``kl``'s shape on the CPU, ``kl`` and ``mask``
    C-contiguous, outside ``torch.compile``, the table's kept plan for that case its fused row
    (:meth:`rlops.scan.Table.run_kept`). Its output is the row's, on the same fields; None where
    the call is not such a one (the general path then checks and runs it)."""
    if not (0.0 < gamma <= 1.0 and 0.0 <= kl_coef and kl_coef - kl_coef == 0):  # (NaN, inf)
        return None
    tensor = torch.Tensor
    if type(kl) is not tensor or type(rewards) is not tensor or type(mask) is not tensor:
        return None
    dtype = kl.dtype
    if rewards.dtype is not dtype or dtype not in PLAIN_DTYPES or mask.dtype is not torch.bool:
        return None
    if kl.dim() != 2 or mask.shape != kl.shape or rewards.dim() != 1:
        return None
    if rewards.shape[0] != kl.shape[0] or kl.device.type != "cpu":
        return None
    if rewards.device.type != "cpu" or mask.device.type != "cpu":
        return None
    if not kl.is_contiguous() or not mask.is_contiguous():
        return None
    if torch.is_grad_enabled() and (kl.requires_grad or rewards.requires_grad):
        return None
    kernel = compiled.reinforce_plain
    return REINFORCE.run_kept(dtype, _FUSED, kernel, kl, rewards, mask, kl_coef, gamma)
