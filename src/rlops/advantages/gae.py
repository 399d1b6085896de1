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
* ``bootstrap`` and ``truncated`` (torchrl's ``done`` vs ``terminated``): a sequence that was
  *cut* (by a length or turn limit) rather than *ended* bootstraps from the value of the state
  after its cut. ``bootstrap`` ``[B]``: every row's end is such a cut, with value
  ``bootstrap[b]``. ``bootstrap`` ``[B, T]`` with ``truncated`` ``[B, T]``: each token with
  ``truncated[t]`` ends its sequence (as a done) and bootstraps from ``bootstrap[b, t]``, the
  value of the state after token t; the other entries are never read (NaN there is harmless).
  The bootstrap is the value that follows the sequence's last action token: mask-0 tokens
  between that token and the cut pass it through, one ``gamma`` in all.

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
from rlops._types import CPLayout, Group
from rlops.advantages import compiled
from rlops.advantages.masking import (
    GaeInputs,
    as_rows,
    bootstrap_inputs,
    indicators,
    next_action_value,
    returns_input,
    td_residual,
    token_decay,
)
from rlops.advantages.reference import gae_reference
from rlops.distributed.collectives import fails_together
from rlops.distributed.layout import check_cp_layout
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

__all__ = ["RETURNS", "context_parallel_row", "discounted_returns", "gae"]


@dataclasses.dataclass(frozen=True)
class Returns:
    """One checked call of the family: ``r``/``v`` ``[B, T]`` in the compute dtype (``v`` None
    for discounted returns), ``mask``/``dones`` bool or None (``dones``: every sequence end,
    truncations included), ``gamma`` and ``gamma_lam`` floats or ``[B, 1]`` tensors as given
    (``gamma_lam = gamma`` for returns); ``cut`` ``[B, T]`` the value of the state after each
    end (0 where the sequence terminated) or None, ``end`` ``[B]`` the value after the row's
    last token or None (:func:`rlops.advantages.masking.bootstrap_inputs`)."""

    r: torch.Tensor
    v: torch.Tensor | None
    mask: torch.Tensor | None
    dones: torch.Tensor | None
    gamma: float | torch.Tensor
    gamma_lam: float | torch.Tensor
    chunk_size: int | None = None
    cp_group: Group = None
    cut: torch.Tensor | None = None
    end: torch.Tensor | None = None
    cp_layout: CPLayout = "zigzag"

    def rows(self, value, dtype) -> torch.Tensor:
        """A discount as a ``[B]`` tensor of ``dtype``."""
        return as_rows(value, self.r.shape[0], dtype, self.r.device)

    def inputs(self, dtype) -> GaeInputs:
        """The backends' inputs, with the discounts as ``[B]`` tensors of ``dtype``."""
        g, gl = self.rows(self.gamma, dtype), self.rows(self.gamma_lam, dtype)
        return GaeInputs(self.r, self.v, self.mask, self.dones, g, gl, self.cut, self.end)

    def cast(self, value):
        """A per-row discount in the compute dtype (a float stays a float)."""
        return value.to(self.r.dtype) if isinstance(value, torch.Tensor) else value


def _reference(method: str, c: Returns):
    return gae_reference(c.inputs(c.r.dtype))


def _compiled(method: str, c: Returns):
    # the carry decays by gamma * lam in float64 (see gae_compiled)
    return compiled.gae_compiled(c.inputs(torch.float64))


def _triton(method: str, c: Returns):
    from rlops.advantages.triton import gae_triton  # triton is imported on first use only

    # the discounts are rounded once to the kernels' carry dtype (float32, float64 for float64)
    return gae_triton(c.inputs(torch.float64))


def _chunked(method: str, c: Returns):
    r, mask, gamma = c.r, c.mask, c.cast(c.gamma)
    if c.v is None:
        x = returns_input(r, mask, c.dones, gamma, c.cut, c.end)
        out = scan(x, token_decay(gamma, mask, c.dones, r), method, c.chunk_size)
        out = out if mask is None else torch.where(mask, out, 0.0)
        return out, out
    nxt = next_action_value(c.v, mask, c.dones, method, c.chunk_size, c.cut, c.end)
    delta = td_residual(r, c.v, nxt, gamma, mask)
    adv = scan(delta, token_decay(c.cast(c.gamma_lam), mask, c.dones, r), method, c.chunk_size)
    ret = c.v + adv
    if mask is not None:
        adv = torch.where(mask, adv, 0.0)
        ret = torch.where(mask, ret, 0.0)
    return adv, ret


def _context_parallel(method: str, c: Returns):
    from rlops.advantages.context_parallel import Layout, bootstrap_fields, cp_gae, cp_scan

    layout = Layout(c.cp_group, c.cp_layout)
    if c.v is None:
        gamma = c.cast(c.gamma)
        # the row's end value enters on the rank holding the row's last token
        end = c.end if layout.holds_end else None
        x = returns_input(c.r, c.mask, c.dones, gamma, c.cut, end)
        decay = token_decay(gamma, c.mask, c.dones, c.r)
        params = (gamma, bootstrap_fields(c.end, c.cut, c.r.device))
        out = cp_scan(x, decay, layout, method, c.chunk_size, params=params)
        out = out if c.mask is None else torch.where(c.mask, out, 0.0)
        return out, out
    return cp_gae(c.inputs(c.r.dtype), layout, method, c.chunk_size)


def _in_context_parallel(case) -> bool:
    return case.cp


def context_parallel_row(fn) -> Row:
    """A table's first row: under ``cp_group`` every method runs ``fn``, the carry-only form,
    whose local scans run the resolved method."""
    return Row((REFERENCE, CHUNKED, COMPILED, TRITON_FORWARD), fn, when=_in_context_parallel)


def _no_zero_discount(case) -> bool:
    return not case.zero_discount()


# GAE and discounted returns: (method, device, grad, dtype, CP) -> implementation. The
# backends' requirements (numba, CPU, CUDA or the interpreter, no gradient) are checked by the
# dispatch.
RETURNS = Table(
    "gae and discounted_returns",
    [
        context_parallel_row(_context_parallel),
        Row((REFERENCE,), _reference, small_ops=True),
        Row((COMPILED,), _compiled, when=_no_zero_discount),
        Row((TRITON_FORWARD,), _triton),  # the kernels cut exactly: any discount
        Row((CHUNKED,), _chunked, small_ops=True),
    ],
)


@fails_together("RLOPS_CP_CHECK")
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    *,
    gamma: float | torch.Tensor,
    lam: float | torch.Tensor,
    mask: torch.Tensor | None = None,
    dones: torch.Tensor | None = None,
    bootstrap: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    method: str = "auto",
    chunk_size: int | None = None,
    cp_group: Group = None,
    cp_layout: CPLayout = "zigzag",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al., 2016, https://arxiv.org/abs/1506.02438).

        delta[t] = r[t] + gamma * V[next(t)] - V[t]
        A[t]     = delta[t] + gamma * lam * A[next(t)]
        returns  = V + A

    where ``next(t)`` is the next action token of the same sequence; past the last one
    ``V = 0`` and ``A = 0`` (the sequence terminated), or ``V`` is the bootstrap value when it
    was truncated (below). Without ``mask`` and ``dones``, ``next(t) = t+1``. Walking back in
    time, the recurrence every method computes is, per row, with the state ``(W, A)`` (the
    value and advantage of the next action token):

        start (after the row's last token):  W = bootstrap[b] ([B] form) or 0,  A = 0
        at a sequence end t (done or truncated), before token t:
                                             W = bootstrap[b, t] if truncated[t] else 0,  A = 0
        at an action token t:                A[t] = r[t] + gamma * W - V[t] + gamma * lam * A
                                             W = V[t],  A = A[t]
        at a mask-0 token:                   output 0; W and A pass through unchanged

    Bootstrap (truncated rows, torchrl's ``done`` vs ``terminated``): a sequence that was
    *terminated* has nothing after its last action token (``V = 0``, ``A = 0``, as above); a
    sequence that was *truncated* (cut by a length or turn limit) continues into a state whose
    value is known, ``V(s')``, and its last action token ``t*`` reads it:

        delta[t*] = r[t*] + gamma * V(s') - V[t*]        A[t*] = delta[t*]

    * ``bootstrap`` ``[B]``: every row is cut at its end; ``V(s') = bootstrap[b]``, the value
      of the state after the row's last token, read by the row's last sequence (after its last
      done, if any). Trailing mask-0 tokens (padding, a tool output) pass it through: it is
      the value after the row's last action token, one ``gamma`` away.
    * ``bootstrap`` ``[B, T]`` with ``truncated`` ``[B, T]`` (bool or 0/1): ``truncated[t]``
      ends a sequence at token t (as a done does; it need not be in ``dones`` too) and that
      sequence reads ``V(s') = bootstrap[b, t]``, the value of the state after token t. Entries
      of ``bootstrap`` where ``truncated`` is False are never read. A row's end is then a
      termination unless ``truncated`` marks a token at or after its last action token. A
      truncation on a mask-0 token (a cut after a tool output) bootstraps the last action token
      before it, one ``gamma`` away. A done that is not in ``truncated`` terminates.

    The mapping from torchrl (``done``, ``terminated``, ``next_state_value``, no mask): pass
    ``dones=done``, ``truncated=(done & ~terminated)`` with its last column set where the
    trajectory does not end in a done (torchrl bootstraps there), and
    ``bootstrap=next_state_value``; every other step's next value is ``values[t + 1]``
    here, as it is in torchrl when ``next_state_value[t] == state_value[t + 1]``.

    Under context parallelism a ``[B]`` bootstrap is the same on every rank and enters at
    the rank holding the row's last chunk; ``bootstrap`` ``[B, T]`` and ``truncated`` are
    shards like ``rewards``.

    Args:
        rewards: ``[B, T]`` per-token rewards (floating). Rewards on mask-0 tokens are ignored.
        values: ``[B, T]`` value estimates.
        gamma: the discount, a float in [0, 1] or a per-row tensor ``[B]``.
        lam: GAE's λ, a float in [0, 1] or a per-row tensor ``[B]`` (e.g. length-adaptive
            lambda).
        mask: optional ``[B, T]`` bool or 0/1, 1 = action token; mask-0 tokens are skipped,
            not reset (see the module docstring).
        dones: optional ``[B, T]`` bool or 0/1; ``dones[t]`` ends a sequence at token t.
        bootstrap: optional floating ``[B]`` (the value after each row's end) or ``[B, T]``
            (the value after each token, read where ``truncated``), cast to the compute dtype.
            Differentiable like ``values``.
        truncated: optional ``[B, T]`` bool or 0/1, with a ``[B, T]`` bootstrap only: where a
            sequence is cut (and bootstraps) rather than terminated.
        method: ``"auto"``, ``"reference"``, ``"chunked"``, ``"compiled"`` or ``"triton"``
            (the last two without a gradient).
        chunk_size: chunk length for ``"chunked"``.
        cp_group: a context-parallel process group: all inputs are then this rank's shards
            ``[B, T_local]`` (:func:`rlops.distributed.cp_shard`) and so are the outputs; one
            ``all_gather`` of five numbers per chunk and row, independent of T.
        cp_layout: the shards' layout under ``cp_group``: ``"zigzag"`` (Megatron's
            load-balanced layout: rank r holds chunks r and 2·cp−1−r of 2·cp) or
            ``"contiguous"`` (slime's ``--allgather-cp``: rank r holds the r-th 1/cp of the
            row). Only carries cross ranks in either.

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
        >>> rlops.gae(r, v, gamma=1.0, lam=1.0, bootstrap=torch.tensor([2.0]))[0]  # cut
        tensor([[2.5000, 2.5000, 2.5000]])

        Three responses packed in one row (``dones`` at each one's last token; the second
        has a tool output at token 3), V = 0, γ = λ = 1: each token's reward-to-go within
        its own response, nothing crossing a done:

        >>> r = torch.tensor([[0.0, 1.0, 0.0, 9.0, 2.0, 3.0]])
        >>> dones = torch.tensor([[0, 1, 0, 0, 1, 1]])
        >>> m = torch.tensor([[1, 1, 1, 0, 1, 1]])
        >>> rlops.gae(r, torch.zeros_like(r), gamma=1.0, lam=1.0, mask=m, dones=dones)[0]
        tensor([[1., 1., 2., 0., 2., 3.]])
    """
    rewards = check_2d("rewards", rewards)
    values = as_float_tensor("values", values)
    if values.shape != rewards.shape:
        raise shape_error("values", f"[B, T] like rewards {list(rewards.shape)}", values.shape)
    check_same_device("rewards", rewards, values=values)
    check_chunk_size(chunk_size)
    check_cp_layout(cp_layout)
    b = rewards.shape[0]
    gamma_ = per_row_discount("gamma", gamma, b, rewards)
    lam_ = per_row_discount("lam", lam, b, rewards)
    mask, dones = indicators(rewards.shape, rewards, mask, dones)
    out_dtype = torch.promote_types(rewards.dtype, values.dtype)
    dtype = compute_dtype(out_dtype)
    ends, cut, end = bootstrap_inputs(bootstrap, truncated, rewards, dones, dtype)
    gl = gamma_ * lam_
    case = case_of(
        rewards, values, gamma_, lam_, bootstrap, cp=cp_group is not None, discounts=(gamma_, gl)
    )
    call = Returns(
        rewards.to(dtype), values.to(dtype), mask, ends, gamma_, gl, chunk_size, cp_group,
        cut, end, cp_layout,
    )  # fmt: skip
    adv, ret = RETURNS(method, case, call)
    return adv.to(out_dtype), ret.to(out_dtype)


@fails_together("RLOPS_CP_CHECK")
def discounted_returns(
    rewards: torch.Tensor,
    *,
    gamma: float | torch.Tensor,
    mask: torch.Tensor | None = None,
    dones: torch.Tensor | None = None,
    bootstrap: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    method: str = "auto",
    chunk_size: int | None = None,
    cp_group: Group = None,
    cp_layout: CPLayout = "zigzag",
) -> torch.Tensor:
    """Discounted returns (reward-to-go) over action tokens.

        G[t] = r[t] + gamma * G[next(t)]

    with ``next(t)`` the next action token of the same sequence; past the last one ``G = 0``
    (the sequence terminated) or ``G = V(s')``, the bootstrap value, when it was truncated.
    ``mask``, ``dones``, ``bootstrap`` and ``truncated`` as in :func:`gae`: mask-0 tokens are
    skipped (their rewards ignored, output 0), a done ends a sequence. Walking back in time,
    per row:

        start (after the row's last token):  G = bootstrap[b] ([B] form) or 0
        at a sequence end t (done or truncated), before token t:
                                             G = bootstrap[b, t] if truncated[t] else 0
        at an action token t:                G[t] = r[t] + gamma * G;  G = G[t]
        at a mask-0 token:                   output 0; G passes through unchanged

    See :func:`gae` for ``bootstrap`` (``[B]``: the rows are cut at their end; ``[B, T]`` with
    ``truncated``: the sequences are cut where ``truncated`` says).

    Args:
        rewards: ``[B, T]`` floating.
        gamma: a float in [0, 1] or a per-row tensor ``[B]``.
        mask: optional ``[B, T]`` bool or 0/1, 1 = action token.
        dones: optional ``[B, T]`` bool or 0/1; ``dones[t]`` ends a sequence at token t.
        bootstrap: optional floating ``[B]`` or ``[B, T]`` (with ``truncated``), as in
            :func:`gae`.
        truncated: optional ``[B, T]`` bool or 0/1, as in :func:`gae`.
        method: ``"auto"``, ``"reference"``, ``"chunked"``, ``"compiled"`` or ``"triton"``
            (the last two without a gradient).
        chunk_size: chunk length for ``"chunked"``.
        cp_group: a context-parallel process group; inputs and output are this rank's shards,
            as in :func:`gae`.
        cp_layout: ``"zigzag"`` or ``"contiguous"``, as in :func:`gae`.

    Returns:
        ``[B, T]`` returns in the dtype of ``rewards``.

    Example:
        >>> import torch, rlops
        >>> r = torch.tensor([[1.0, 5.0, 1.0]])
        >>> rlops.discounted_returns(r, gamma=0.5, mask=torch.tensor([[1, 0, 1]]))
        tensor([[1.5000, 0.0000, 1.0000]])
        >>> r = torch.tensor([[0.0, 1.0, 0.0, 1.0]])  # two sequences; the first was cut at t=1
        >>> cut = torch.tensor([[0, 1, 0, 0]], dtype=torch.bool)
        >>> boot = torch.tensor([[0.0, 3.0, 0.0, 0.0]])  # the value after token 1
        >>> rlops.discounted_returns(r, gamma=0.5, bootstrap=boot, truncated=cut)
        tensor([[1.2500, 2.5000, 0.5000, 1.0000]])
    """
    rewards = check_2d("rewards", rewards)
    check_chunk_size(chunk_size)
    check_cp_layout(cp_layout)
    gamma_ = per_row_discount("gamma", gamma, rewards.shape[0], rewards)
    mask, dones = indicators(rewards.shape, rewards, mask, dones)
    dtype = compute_dtype(rewards.dtype)
    ends, cut, end = bootstrap_inputs(bootstrap, truncated, rewards, dones, dtype)
    case = case_of(rewards, gamma_, bootstrap, cp=cp_group is not None, discounts=(gamma_,))
    r = rewards.to(dtype)
    call = Returns(r, None, mask, ends, gamma_, gamma_, chunk_size, cp_group, cut, end, cp_layout)
    return RETURNS(method, case, call)[1].to(rewards.dtype)
