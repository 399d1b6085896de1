"""GAE and discounted returns on the discounted reverse scan.

Both take ``[B, T]`` tensors and share the semantics of ``mask`` and ``dones``
(:mod:`rlops.advantages.masking`):

* ``mask`` (1 = action token): tokens with mask 0 (prompt padding, tool output, observations)
  are *skipped*, not treated as a reset. On every action token the result equals the
  estimator run on the row's compacted, action-only sequence; outputs are 0 on mask-0 tokens
  and rewards placed on mask-0 tokens are ignored. Right padding is simply mask 0.
* ``dones`` (``dones[t] = True``: token t ends its sequence): nothing flows from t+1 into t
  or earlier, for packed rows holding several sequences; not even NaN or inf. A done on a
  mask-0 token cuts too.

Which implementation runs is decided by one table, :data:`RETURNS` (:mod:`rlops.scan.dispatch`):
``"reference"`` (:mod:`rlops.advantages.reference`, the loop), ``"compiled"``
(:mod:`rlops.advantages.compiled`, fused numba kernels; a zero discount goes to chunked, since
the kernels multiply their carries), ``"triton"`` (:mod:`rlops.advantages.triton`, one Triton
kernel per estimator on CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``; zero
discounts and dones are exact cuts there; forward only, so refused where an input requires
grad, as compiled is), ``"chunked"`` (scans built from :mod:`rlops.advantages.masking`), and
with ``cp_group=`` the carry-only forms of :mod:`rlops.advantages.context_parallel`, whose
local scans run the resolved method.
"""

from __future__ import annotations

import dataclasses

import torch

from rlops._checks import (
    as_float_tensor,
    check_2d,
    check_chunk_size,
    check_same_device,
    compute_dtype,
    per_row_discount,
    shape_error,
)
from rlops.advantages import compiled
from rlops.advantages.masking import (
    as_rows,
    indicators,
    next_action_value,
    td_residual,
    token_decay,
)
from rlops.advantages.reference import gae_reference
from rlops.scan import scan
from rlops.scan.dispatch import (
    CHUNKED,
    COMPILED,
    REFERENCE,
    TRITON_FORWARD,
    Row,
    Table,
    case_of,
)

__all__ = ["RETURNS", "discounted_returns", "gae"]


@dataclasses.dataclass(frozen=True)
class Returns:
    """One checked call of the family: ``r``/``v`` ``[B, T]`` in the compute dtype (``v`` None
    for discounted returns), ``mask``/``dones`` bool or None, ``gamma`` and ``gamma_lam`` floats
    or ``[B, 1]`` tensors as given (``gamma_lam = gamma`` for returns)."""

    r: torch.Tensor
    v: torch.Tensor | None
    mask: torch.Tensor | None
    dones: torch.Tensor | None
    gamma: float | torch.Tensor
    gamma_lam: float | torch.Tensor
    chunk_size: int | None = None
    cp_group: object | None = None

    def rows(self, value, dtype) -> torch.Tensor:
        """A discount as a ``[B]`` tensor of ``dtype``."""
        return as_rows(value, self.r.shape[0], dtype, self.r.device)

    def cast(self, value):
        """A per-row discount in the compute dtype (a float stays a float)."""
        return value.to(self.r.dtype) if isinstance(value, torch.Tensor) else value


def _reference(method: str, c: Returns):
    g, gl = c.rows(c.gamma, c.r.dtype), c.rows(c.gamma_lam, c.r.dtype)
    return gae_reference(c.r, c.v, c.mask, c.dones, g, gl)


def _compiled(method: str, c: Returns):
    # the carry decays by gamma * lam in float64 (see gae_compiled)
    g, gl = c.rows(c.gamma, torch.float64), c.rows(c.gamma_lam, torch.float64)
    return compiled.gae_compiled(c.r, c.v, c.mask, c.dones, g, gl)


def _triton(method: str, c: Returns):
    from rlops.advantages.triton import gae_triton  # triton is imported on first use only

    # the discounts are rounded once to the kernels' carry dtype (float32, float64 for float64)
    g, gl = c.rows(c.gamma, torch.float64), c.rows(c.gamma_lam, torch.float64)
    return gae_triton(c.r, c.v, c.mask, c.dones, g, gl)


def _chunked(method: str, c: Returns):
    r, mask, gamma = c.r, c.mask, c.cast(c.gamma)
    if c.v is None:
        x = r if mask is None else torch.where(mask, r, 0.0)
        out = scan(x, token_decay(gamma, mask, c.dones, r), method, c.chunk_size)
        out = out if mask is None else torch.where(mask, out, 0.0)
        return out, out
    nxt = next_action_value(c.v, mask, c.dones, method, c.chunk_size)
    delta = td_residual(r, c.v, nxt, gamma, mask)
    adv = scan(delta, token_decay(c.cast(c.gamma_lam), mask, c.dones, r), method, c.chunk_size)
    ret = c.v + adv
    if mask is not None:
        adv = torch.where(mask, adv, 0.0)
        ret = torch.where(mask, ret, 0.0)
    return adv, ret


def _context_parallel(method: str, c: Returns):
    from rlops.advantages.context_parallel import cp_gae, cp_scan

    if c.v is None:
        gamma = c.cast(c.gamma)
        x = c.r if c.mask is None else torch.where(c.mask, c.r, 0.0)
        decay = token_decay(gamma, c.mask, c.dones, c.r)
        out = cp_scan(x, decay, c.cp_group, method, c.chunk_size, params=(gamma, None))
        out = out if c.mask is None else torch.where(c.mask, out, 0.0)
        return out, out
    g, gl = c.rows(c.gamma, c.r.dtype), c.rows(c.gamma_lam, c.r.dtype)
    return cp_gae(c.r, c.v, c.mask, c.dones, g, gl, c.cp_group, method, c.chunk_size)


def _in_context_parallel(case) -> bool:
    return case.cp


def _no_zero_discount(case) -> bool:
    return not case.zero_discount()


# GAE and discounted returns: (method, device, grad, dtype, CP) -> implementation. The
# backends' requirements (numba, CPU, CUDA or the interpreter, no gradient) are checked by the
# dispatch.
RETURNS = Table(
    "gae and discounted_returns",
    [
        Row(
            (REFERENCE, CHUNKED, COMPILED, TRITON_FORWARD),
            _context_parallel,
            when=_in_context_parallel,
        ),
        Row((REFERENCE,), _reference, small_ops=True),
        Row((COMPILED,), _compiled, when=_no_zero_discount),
        Row((TRITON_FORWARD,), _triton),  # the kernels cut exactly: any discount
        Row((CHUNKED,), _chunked, small_ops=True),
    ],
)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    *,
    gamma: float | torch.Tensor,
    lam: float | torch.Tensor,
    mask: torch.Tensor | None = None,
    dones: torch.Tensor | None = None,
    method: str = "auto",
    chunk_size: int | None = None,
    cp_group: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al., 2016, https://arxiv.org/abs/1506.02438).

        delta[t] = r[t] + gamma * V[next(t)] - V[t]
        A[t]     = delta[t] + gamma * lam * A[next(t)]
        returns  = V + A

    where ``next(t)`` is the next action token of the same sequence; past the last one
    ``V = 0`` and ``A = 0`` (no bootstrap). Without ``mask`` and ``dones``, ``next(t) = t+1``.

    Args:
        rewards: ``[B, T]`` per-token rewards (floating). Rewards on mask-0 tokens are ignored.
        values: ``[B, T]`` value estimates.
        gamma, lam: floats in [0, 1], or per-row tensors ``[B]`` (e.g. length-adaptive lambda).
        mask: optional ``[B, T]`` bool or 0/1, 1 = action token; mask-0 tokens are skipped,
            not reset (see the module docstring).
        dones: optional ``[B, T]`` bool or 0/1; ``dones[t]`` ends a sequence at token t.
        method: ``"auto"``, ``"reference"``, ``"chunked"``, ``"compiled"`` or ``"triton"``
            (the last two without a gradient).
        chunk_size: chunk length for ``"chunked"``.
        cp_group: a context-parallel process group: all inputs are then this rank's zigzag
            shards ``[B, T_local]`` (:func:`rlops.distributed.zigzag_shard`) and so are the
            outputs; one ``all_gather`` of five numbers per chunk and row, independent of T.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` in the promoted dtype of ``rewards`` and
        ``values``, 0 on mask-0 tokens. Half-precision inputs are accumulated in float32.

    Example:
        >>> import torch, rlops
        >>> r = torch.tensor([[0.0, 0.0, 1.0]])
        >>> v = torch.tensor([[0.5, 0.5, 0.5]])
        >>> adv, ret = rlops.gae(r, v, gamma=1.0, lam=1.0)
        >>> adv
        tensor([[0.5000, 0.5000, 0.5000]])
        >>> m = torch.tensor([[1, 0, 1]])  # token 1 is a tool output: skipped, not a reset
        >>> rlops.gae(r, v, gamma=0.5, lam=1.0, mask=m)[0]
        tensor([[0.0000, 0.0000, 0.5000]])
    """
    rewards = check_2d("rewards", rewards)
    values = as_float_tensor("values", values)
    if values.shape != rewards.shape:
        raise shape_error("values", f"[B, T] like rewards {list(rewards.shape)}", values.shape)
    check_same_device("rewards", rewards, values=values)
    check_chunk_size(chunk_size)
    b = rewards.shape[0]
    gamma_ = per_row_discount("gamma", gamma, b, rewards)
    lam_ = per_row_discount("lam", lam, b, rewards)
    mask, dones = indicators(rewards.shape, rewards, mask, dones)
    out_dtype = torch.promote_types(rewards.dtype, values.dtype)
    dtype = compute_dtype(out_dtype)
    gl = gamma_ * lam_
    case = case_of(
        rewards, values, gamma_, lam_, cp=cp_group is not None, discounts=(gamma_, gl)
    )
    call = Returns(
        rewards.to(dtype), values.to(dtype), mask, dones, gamma_, gl, chunk_size, cp_group
    )
    adv, ret = RETURNS(method, case, call)
    return adv.to(out_dtype), ret.to(out_dtype)


def discounted_returns(
    rewards: torch.Tensor,
    *,
    gamma: float | torch.Tensor,
    mask: torch.Tensor | None = None,
    dones: torch.Tensor | None = None,
    method: str = "auto",
    chunk_size: int | None = None,
    cp_group: object | None = None,
) -> torch.Tensor:
    """Discounted returns (reward-to-go) over action tokens.

        G[t] = r[t] + gamma * G[next(t)]

    with ``next(t)`` the next action token of the same sequence (``G = 0`` past the last).
    ``mask`` and ``dones`` as in :func:`gae`: mask-0 tokens are skipped (their rewards ignored,
    output 0), a done ends a sequence.

    Args:
        rewards: ``[B, T]`` floating.
        gamma: a float in [0, 1] or a per-row tensor ``[B]``.
        mask, dones: optional ``[B, T]`` bool or 0/1.
        method: ``"auto"``, ``"reference"``, ``"chunked"``, ``"compiled"`` or ``"triton"``
            (the last two without a gradient).
        chunk_size: chunk length for ``"chunked"``.
        cp_group: a context-parallel process group; inputs and output are this rank's zigzag
            shards, as in :func:`gae`.

    Returns:
        ``[B, T]`` returns in the dtype of ``rewards``.

    Example:
        >>> import torch, rlops
        >>> r = torch.tensor([[1.0, 5.0, 1.0]])
        >>> rlops.discounted_returns(r, gamma=0.5, mask=torch.tensor([[1, 0, 1]]))
        tensor([[1.5000, 0.0000, 1.0000]])
    """
    rewards = check_2d("rewards", rewards)
    check_chunk_size(chunk_size)
    gamma_ = per_row_discount("gamma", gamma, rewards.shape[0], rewards)
    mask, dones = indicators(rewards.shape, rewards, mask, dones)
    case = case_of(rewards, gamma_, cp=cp_group is not None, discounts=(gamma_,))
    r = rewards.to(compute_dtype(rewards.dtype))
    call = Returns(r, None, mask, dones, gamma_, gamma_, chunk_size, cp_group)
    return RETURNS(method, case, call)[1].to(rewards.dtype)
