"""GAE and discounted returns on the discounted reverse scan, and their dispatch table
:data:`RETURNS`: the loop (``reference.py``), the fused numba and Triton kernels (forward only;
numba's not on a zero discount), the chunked scans built by ``_masking.py``, and under
``cp_group=`` the carry-only forms of ``context_parallel.py``, each taking the call's one
carrier, :class:`GaeInputs`. What ``mask``, ``dones`` and the bootstrap mean: the API guide and
docs/design/masks.md.
"""

from __future__ import annotations

import torch

from rlops._checks import (
    as_dtype,
    as_float_tensor,
    check_2d,
    check_chunk_size,
    check_finite_positive,
    check_same_device,
    compute_dtype,
    per_row_discount,
    shape_error,
)
from rlops._types import CPLayout, Group
from rlops.advantages import compiled
from rlops.advantages._masking import (
    GaeInputs,
    bootstrap_inputs,
    indicators,
    next_action_value,
    returns_input,
    td_residual,
    token_decay,
)
from rlops.advantages.reference import gae_reference
from rlops.distributed.collectives import Call, fails_together
from rlops.distributed.layout import check_cp_layout
from rlops.distributed.rows import Rows
from rlops.scan import (
    CHUNKED,
    COMPILED,
    REFERENCE,
    TRITON_FORWARD,
    Row,
    Table,
    scan,
)

__all__ = ["RETURNS", "GaeInputs", "context_parallel_row", "discounted_returns", "gae"]


def _reference(method: str, c: GaeInputs):
    c = c.widened()
    return gae_reference(c.per_row(c.rewards.dtype))


def _compiled(method: str, c: GaeInputs):
    # the carry decays by gamma * lam in float64 (see gae_compiled)
    return compiled.gae_compiled(c)


def _triton(method: str, c: GaeInputs):
    from rlops.advantages.triton import gae_triton  # triton is imported on first use only

    # the discounts are rounded once to the kernels' carry dtype (float32, float64 for float64)
    return gae_triton(c.widened().per_row(torch.float64))


def _chunked(method: str, c: GaeInputs):
    c = c.widened()
    r, v, mask, gamma = c.rewards, c.values, c.mask, c.cast(c.gamma)
    if v is None:
        x = returns_input(r, mask, c.dones, gamma, c.cut, c.end)
        out = scan(x, token_decay(gamma, mask, c.dones, r), method, c.chunk_size)
        out = out if mask is None else torch.where(mask, out, 0.0)
        return out, out
    nxt = next_action_value(v, mask, c.dones, method, c.chunk_size, c.cut, c.end)
    delta = td_residual(r, v, nxt, gamma, mask)
    adv = scan(delta, token_decay(c.cast(c.gamma_lam), mask, c.dones, r), method, c.chunk_size)
    ret = v + adv
    if mask is not None:
        adv = torch.where(mask, adv, 0.0)
        ret = torch.where(mask, ret, 0.0)
    return adv, ret


def _context_parallel(method: str, c: GaeInputs):
    from rlops.advantages.context_parallel import Layout, bootstrap_fields, cp_gae, cp_scan

    layout, c = Layout(c.cp_group, c.cp_layout), c.widened()
    if c.values is None:
        gamma = c.cast(c.gamma)
        # the row's end value enters on the rank holding the row's last token
        end = c.end if layout.holds_end else None
        x = returns_input(c.rewards, c.mask, c.dones, gamma, c.cut, end)
        decay = token_decay(gamma, c.mask, c.dones, c.rewards)
        params = (gamma, bootstrap_fields(c.end, c.cut, c.rewards.device))
        out = cp_scan(x, decay, layout, method, c.chunk_size, params=params)
        out = out if c.mask is None else torch.where(c.mask, out, 0.0)
        return out, out
    return cp_gae(c.per_row(c.rewards.dtype), layout, method, c.chunk_size)


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
_COMPILED = Row((COMPILED,), _compiled, when=_no_zero_discount)

RETURNS = Table(
    "gae and discounted_returns",
    [
        context_parallel_row(_context_parallel),
        Row((REFERENCE,), _reference, small_ops=True),
        _COMPILED,
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
    returns_lam: float | torch.Tensor | None = None,
    lam_length_alpha: float | None = None,
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

    VAPO's decoupled λ (https://arxiv.org/abs/2504.05118, as NeMo-RL's ``gae_lambda_policy``,
    ``gae_lambda_value`` and ``length_adaptive_alpha``): the returns are ``V + A`` of a GAE with
    ``returns_lam``; with ``lam_length_alpha = α`` the advantages take per row
    ``lam_b = 1 − 1 / max(α·L_b, 1)``, ``L_b`` the row's action tokens (on all ranks of
    ``cp_group``). Two λ: the rows stacked, one scan per step.

    ``next(t)`` is the next action token of the same sequence (``t + 1`` without ``mask`` and
    ``dones``); past a sequence's last one ``V = A = 0`` (terminated), or ``V`` is the bootstrap
    value (truncated). Mask-0 tokens are skipped, not reset; a done ends a sequence.

    Args:
        rewards: ``[B, T]`` per-token rewards (floating); ignored on mask-0 tokens.
        values: ``[B, T]`` value estimates.
        gamma: the discount, a float in [0, 1] or a per-row tensor ``[B]``.
        lam: GAE's λ, a float in [0, 1] or a per-row tensor ``[B]``: the advantages' (unless
            ``lam_length_alpha``) and the returns' (unless ``returns_lam``).
        returns_lam: optional λ of the returns (the value targets), as ``lam``.
        lam_length_alpha: optional α > 0 (VAPO's 0.05): the advantages' λ from each row's
            length; one sequence per row (refused with ``dones`` or ``truncated``).
        mask: optional ``[B, T]`` bool or 0/1, 1 = action token.
        dones: optional ``[B, T]`` bool or 0/1; ``dones[t]`` ends a sequence at token t.
        bootstrap: optional floating ``[B]`` (the value after each row's end, where it is cut)
            or ``[B, T]`` (the value after each token, read where ``truncated``).
        truncated: optional ``[B, T]`` bool or 0/1: where a sequence is cut rather than
            terminated (torchrl's ``done & ~terminated``), with a ``[B, T]`` bootstrap.
        method: ``"auto"``, ``"reference"``, ``"chunked"``, ``"compiled"`` or ``"triton"``
            (the last two without a gradient).
        chunk_size: chunk length for ``"chunked"``.
        cp_group: a context-parallel group: inputs and outputs are this rank's shards
            (:func:`rlops.distributed.cp_shard`); one ``all_gather``.
        cp_layout: the shards' layout, ``"zigzag"`` (Megatron's) or ``"contiguous"`` (slime's).

    Returns:
        ``(advantages, returns)``, ``[B, T]`` in the promoted dtype of ``rewards`` and ``values``
        (half precision accumulated in float32), 0 on mask-0 tokens.

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

        Three responses packed in one row (a done ends each; token 3 is a tool output):

        >>> r = torch.tensor([[0.0, 1.0, 0.0, 9.0, 2.0, 3.0]])
        >>> dones = torch.tensor([[0, 1, 0, 0, 1, 1]])
        >>> m = torch.tensor([[1, 1, 1, 0, 1, 1]])
        >>> rlops.gae(r, torch.zeros_like(r), gamma=1.0, lam=1.0, mask=m, dones=dones)[0]
        tensor([[1., 1., 2., 0., 2., 3.]])

        VAPO: the value targets with λ = 1, the advantages with λ = 1 − 1/(0.5·3):

        >>> r, v = torch.tensor([[0.0, 0.0, 1.0]]), torch.zeros(1, 3)
        >>> rlops.gae(r, v, gamma=1.0, lam=1.0, lam_length_alpha=0.5)
        (tensor([[0.1111, 0.3333, 1.0000]]), tensor([[1., 1., 1.]]))
    """
    if (
        dones is None
        and bootstrap is None
        and truncated is None
        and returns_lam is None
        and lam_length_alpha is None
        and method == "auto"
        and chunk_size is None
        and cp_group is None
        and cp_layout == "zigzag"
        and type(gamma) is float
        and type(lam) is float
    ):
        plain = _plain(rewards, values, gamma, lam, mask)
        if plain is not None:
            return plain
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
    ret_lam = (
        lam_ if returns_lam is None else per_row_discount("returns_lam", returns_lam, b, rewards)
    )
    alpha = None
    if lam_length_alpha is not None:
        alpha = check_finite_positive("lam_length_alpha", lam_length_alpha)
    mask, dones = indicators(rewards.shape, rewards, mask, dones)
    out_dtype = rewards.dtype  # (promote_types is a dispatch: microseconds, caches cold)
    if values.dtype != out_dtype:
        out_dtype = torch.promote_types(out_dtype, values.dtype)
    dtype = compute_dtype(out_dtype)
    ends, cut, end = bootstrap_inputs(bootstrap, truncated, rewards, dones, dtype)
    adv_lam = lam_
    if alpha is not None:
        if ends is not None:
            raise ValueError(
                "lam_length_alpha needs one sequence per row (L_b, the row's action tokens, is "
                "the response length): rows packed with dones= or truncated= are not supported; "
                "unpack them, or pass each row's λ as lam (a [B] tensor)"
            )
        adv_lam = _length_adaptive_lam(alpha, mask, rewards, cp_group, cp_layout)
    # bfloat16 stays so until a row needs float32 (GaeInputs.widened): the compiled kernels read it
    if not rewards.dtype == values.dtype == torch.bfloat16:
        rewards, values = as_dtype(rewards, dtype), as_dtype(values, dtype)
    call = GaeInputs(
        rewards, values, mask, ends, gamma_, gamma_ * adv_lam, cut, end,
        chunk_size, cp_group, cp_layout,
    )  # fmt: skip
    floats = isinstance(ret_lam, float) and isinstance(adv_lam, float)
    if ret_lam is adv_lam or (floats and ret_lam == adv_lam):
        adv, ret = RETURNS(method, call.case, call)
    else:  # two λ: the rows stacked, the advantages from the first half, returns the second
        both = call.twice(gamma_ * ret_lam)
        adv, ret = RETURNS(method, both.case, both)
        adv, ret = adv[:b], ret[b:]
    return as_dtype(adv, out_dtype), as_dtype(ret, out_dtype)


#: the dtypes of the plain calls (their kernels' own)
PLAIN_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _plain(rewards: object, values: object, gamma: float, lam: float, mask: object):
    """The plain GAE call where auto runs the compiled kernel on it: discounts in (0, 1] (no
    zero discount, their product included), ``rewards`` and ``values`` C-contiguous CPU
    tensors ``[B, T]`` of one dtype (float32, float64 or bfloat16) that need no gradient, no
    mask or a C-contiguous bool one of their shape on the CPU, outside ``torch.compile``, the
    table's kept plan for that case its compiled row (:meth:`rlops.scan.Table.run_kept`;
    none before a first call). Its outputs are the kernel's, as the table's row gives them
    (:func:`compiled.gae_plain`: its launch kept), without the general path's checks,
    carrier and dispatch. None where the call is not such a one: the general path then
    checks and runs it."""
    gamma_lam = gamma * lam  # (as the general path makes it)
    if not (0.0 < gamma <= 1.0 and 0.0 < lam <= 1.0 and gamma_lam > 0.0):  # (NaN: False)
        return None
    if type(rewards) is not torch.Tensor or type(values) is not torch.Tensor:
        return None
    dtype = rewards.dtype
    if values.dtype is not dtype or dtype not in PLAIN_DTYPES or rewards.dim() != 2:
        return None
    if values.shape != rewards.shape or rewards.device.type != "cpu":
        return None
    if values.device.type != "cpu" or not rewards.is_contiguous() or not values.is_contiguous():
        return None
    if torch.is_grad_enabled() and (rewards.requires_grad or values.requires_grad):
        return None
    if mask is not None and not (
        type(mask) is torch.Tensor
        and mask.dtype is torch.bool
        and mask.shape == rewards.shape
        and mask.device.type == "cpu"
        and mask.is_contiguous()
    ):
        return None
    kernel = compiled.gae_plain
    return RETURNS.run_kept(dtype, _COMPILED, kernel, rewards, values, mask, gamma, gamma_lam)


def _length_adaptive_lam(alpha: float, mask, like: torch.Tensor, cp_group, cp_layout):
    """VAPO's ``1 − 1/max(α·L_b, 1)`` per row, ``[B, 1]`` float64, with ``L_b`` the row's
    action tokens on every rank of ``cp_group`` (one gather there)."""
    keep = torch.ones_like(like, dtype=torch.bool) if mask is None else mask
    rows = Rows(keep, torch.float64, cp_group=cp_group, cp_layout=cp_layout)
    if rows.cp:
        fields = {"lam_length_alpha": alpha, **rows.fields()}
        rows.call = Call("gae", implied=None, rows=keep.shape[0], **fields)
    return 1.0 - 1.0 / (alpha * rows.count).clamp_min(1.0)


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
    """Discounted returns (reward-to-go) over action tokens: ``G[t] = r[t] + gamma * G[next(t)]``.

    ``next(t)``, ``mask``, ``dones``, ``bootstrap`` and ``truncated`` as in :func:`gae`: past a
    sequence's last action token ``G = 0`` (terminated) or the bootstrap value (truncated).

    Args:
        rewards: ``[B, T]`` floating.
        gamma: a float in [0, 1] or a per-row tensor ``[B]``.
        mask: optional ``[B, T]`` bool or 0/1, 1 = action token.
        dones: optional ``[B, T]`` bool or 0/1; ``dones[t]`` ends a sequence at token t.
        bootstrap: optional floating ``[B]`` or ``[B, T]``, as in :func:`gae`.
        truncated: optional ``[B, T]`` bool or 0/1, as in :func:`gae`.
        method: as in :func:`gae`.
        chunk_size: chunk length for ``"chunked"``.
        cp_group: a context-parallel group, as in :func:`gae`.
        cp_layout: ``"zigzag"`` or ``"contiguous"``.

    Returns:
        ``[B, T]`` returns in the dtype of ``rewards``, 0 on mask-0 tokens.

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
    r = rewards if rewards.dtype == torch.bfloat16 else as_dtype(rewards, dtype)  # as in gae
    call = GaeInputs(r, None, mask, ends, gamma_, gamma_, cut, end, chunk_size, cp_group, cp_layout)
    return as_dtype(RETURNS(method, call.case, call)[1], rewards.dtype)
