"""Selection masks that do not change with the micro-batch split; batch-wide cuts by a radix
select over ``group`` (docs/design/losses.md). Everything is detached."""

from __future__ import annotations

import math

import torch

from rlops._checks import (
    as_bool_mask,
    check_2d,
    check_bounds,
    check_choice,
    check_nonneg,
    check_positive,
    check_real,
    check_same_shape,
    compute_dtype,
)
from rlops._types import Group
from rlops.corrections.rollout import rollout_importance_weights
from rlops.distributed.collectives import Call, fails_together, gather
from rlops.distributed.groups import group_rank_size

__all__ = [
    "BEHAVIOR_ACTIONS",
    "BEHAVIOR_AGGS",
    "BEHAVIOR_LEVELS",
    "behavior_importance_weights",
    "m2po_mask",
    "opsm_mask",
    "top_entropy_mask",
]

BEHAVIOR_LEVELS = ("token", "sequence")
BEHAVIOR_AGGS = ("sum", "mean", "max")
BEHAVIOR_ACTIONS = ("mask", "clamp")

_BINS = 256
_MAGNITUDE = {torch.float32: (1 << 31) - 1, torch.float64: (1 << 63) - 1}
_INT = {torch.float32: torch.int32, torch.float64: torch.int64}


# --------------------------------------------------------------------------- radix select
def _unsigned_key(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """int64 keys in the float order when unsigned (``-0.0`` as ``+0.0``) and their width."""
    bits = (x + 0.0).view(_INT[x.dtype]).to(torch.int64)
    signed = torch.where(bits < 0, bits ^ _MAGNITUDE[x.dtype], bits)
    if x.dtype == torch.float32:
        return signed + (1 << 31), 32
    return signed ^ (-(1 << 63)), 64


def _signed(u: torch.Tensor, width: int) -> torch.Tensor:
    """Keys of :func:`_unsigned_key` in the signed int64 order (for comparisons)."""
    return u - (1 << 31) if width == 32 else u ^ (-(1 << 63))


def _value(u: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The float of an unsigned key (the inverse of :func:`_unsigned_key`)."""
    k = _signed(u, width)
    bits = torch.where(k < 0, k ^ _MAGNITUDE[dtype], k)
    return bits.to(_INT[dtype]).view(dtype)


def _rounds(
    x: torch.Tensor,
    valid: torch.Tensor,
    weights: list[torch.Tensor],
    targets: int,
    group: Group,
    call: Call,
    choose,
) -> tuple[torch.Tensor, int]:
    """Radix select over ``x`` where ``valid``, on every rank of ``group``; ``choose`` a byte."""
    u, width = _unsigned_key(x.reshape(-1))
    on = valid.reshape(-1)
    prefix = torch.zeros(targets, dtype=torch.int64, device=x.device)
    cols = [
        on.to(torch.float64),
        *(torch.where(on, w.reshape(-1).to(torch.float64), 0.0) for w in weights),
    ]
    for r in range(width // 8):
        shift = width - 8 * (r + 1)
        digit = ((u >> shift) & (_BINS - 1)).expand(targets, -1)
        if r == 0:
            match = torch.ones(targets, u.numel(), dtype=torch.bool, device=x.device)
        else:
            match = (u >> (shift + 8))[None, :] == (prefix >> (shift + 8))[:, None]
        hist = torch.stack(
            [
                torch.zeros(targets, _BINS, dtype=torch.float64, device=x.device).scatter_add_(
                    1, digit, torch.where(match, c, 0.0)
                )
                for c in cols
            ]
        )
        hist = gather(hist, group, call.with_fields(round=r)).sum(0)
        prefix = prefix | (choose(r, hist) << shift)
    return prefix, width


# --------------------------------------------------------------------------- OPSM
@fails_together()
def opsm_mask(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    delta: float = 1e-4,
    cp_group: Group = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Off-policy sequence masking (https://arxiv.org/abs/2512.02556, eq. 9; slime's
    ``compute_opsm_mask``): ``keep = mask and not (advantages < 0 and KL_b > delta)``,
    ``KL_b = mean (old_logp − logp)`` over row b's action tokens (whole rows over ``cp_group``).

    Args:
        logp, old_logp, advantages, mask: ``[B, T]`` current and sampling log-probs, advantages
            and the 0/1 action mask.
        delta: the KL threshold (slime's ``opsm_delta``).
        cp_group: the context-parallel group whose ranks hold pieces of the same rows.

    Returns:
        ``(keep, metrics)``: ``[B, T]`` bool; ``opsm_masked_fraction``, ``opsm_seq_fraction``.

    Example:
        >>> import torch
        >>> logp, old = torch.tensor([[-2.0, -2.0]]), torch.tensor([[-1.0, -1.0]])  # KL = 1
        >>> opsm_mask(logp, old, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2))[0]
        tensor([[False,  True]])
    """
    check_2d("logp", logp)
    check_same_shape("logp", logp, old_logp=old_logp, advantages=advantages)
    keep = as_bool_mask("mask", mask, logp.shape, "logp", logp)
    delta = check_real("delta", delta)
    dtype = compute_dtype(torch.promote_types(logp.dtype, old_logp.dtype))
    d = torch.where(keep, old_logp.detach().to(dtype) - logp.detach().to(dtype), 0)
    rows = torch.stack([d.sum(-1).to(torch.float64), keep.sum(-1).to(torch.float64)], -1)
    if group_rank_size(cp_group, "cp_group")[1] > 1:
        rows = gather(rows, cp_group, Call("opsm_mask", delta=delta), "cp_group").sum(0)
    kl = rows[:, 0] / rows[:, 1].clamp_min(1)
    far = kl > delta
    dropped = keep & (advantages.detach() < 0) & far[:, None]
    n = keep.sum().to(dtype)
    has = rows[:, 1] > 0
    metrics = {
        "opsm_masked_fraction": dropped.sum().to(dtype) / n.clamp_min(1),
        "opsm_seq_fraction": (far & has).sum().to(dtype) / has.sum().to(dtype).clamp_min(1),
    }
    return keep & ~dropped, metrics


# --------------------------------------------------------------------------- M2PO
@fails_together()
def m2po_mask(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    threshold: float,
    group: Group = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """M2PO (https://arxiv.org/abs/2510.01161; AReaL's ``get_m2po_loss_mask``): drop the tokens of
    largest ``d²``, ``d = old_logp − rollout_logp``, until the mean ``d²`` of the rest is below
    ``threshold``, over every rank of ``group`` (ties at the cut all dropped).

    Args:
        old_logp, rollout_logp, mask: ``[B, T]`` trainer (proximal) and behaviour log-probs, mask.
        threshold: ``> 0`` (AReaL's ``m2_threshold``).
        group: the data-parallel group sharing the batch (None: this process only).

    Returns:
        ``(keep, metrics)``: ``[B, T]`` bool; ``m2po_m2``, ``m2po_m2_kept``,
        ``m2po_masked_fraction``, ``m2po_cut`` (the smallest dropped ``d²``; inf if none).

    Example:
        >>> import torch
        >>> d = torch.tensor([[0.1, -0.2, 0.9, 0.05]])  # 0.81 dropped: the rest's mean is 0.0175
        >>> m2po_mask(d, torch.zeros(1, 4), torch.ones(1, 4), threshold=0.04)[0]
        tensor([[ True,  True, False,  True]])
    """
    check_2d("old_logp", old_logp)
    check_same_shape("old_logp", old_logp, rollout_logp=rollout_logp)
    keep = as_bool_mask("mask", mask, old_logp.shape, "old_logp", old_logp)
    tau = check_positive("threshold", threshold)
    group_rank_size(group)
    dtype = compute_dtype(torch.promote_types(old_logp.dtype, rollout_logp.dtype))
    d = old_logp.detach().to(dtype) - rollout_logp.detach().to(dtype)
    m2 = torch.where(keep, d.square(), 0)
    state: dict[str, torch.Tensor] = {}

    def choose(r: int, hist: torch.Tensor) -> torch.Tensor:
        count, g = hist[0, 0], hist[1, 0]
        if r == 0:
            state.update(
                n=count.sum(),
                total=g.sum(),
                below_n=count.new_zeros(()),
                below_g=count.new_zeros(()),
                found=torch.ones((), dtype=torch.bool, device=count.device),
            )
        c_end = state["below_n"] + count.cumsum(0)
        g_end = state["below_g"] + g.cumsum(0)
        rising = (g_end >= 0) & (c_end > 0)
        state["found"] = state["found"] & rising.any()
        digit = rising.to(torch.int8).argmax().reshape(1)  # the first bin where h rises to 0
        at_n = count.gather(0, digit)[0]
        state["below_n"] = c_end.gather(0, digit)[0] - at_n
        state["below_g"] = (g_end.gather(0, digit) - g.gather(0, digit))[0]
        state["at_n"] = at_n
        return digit.to(torch.int64)

    call = Call("m2po_mask", threshold=tau, dtype=dtype)
    prefix, width = _rounds(m2, keep, [m2 - tau], 1, group, call, choose)
    key = _signed(_unsigned_key(m2)[0], width)
    cut_key = _signed(prefix, width)[0]
    found, at_min = state["found"], state["below_n"] == 0
    chosen = torch.where(at_min, key == cut_key, key < cut_key)
    keep_out = keep & torch.where(found, chosen, True)
    n = state["n"]
    kept_n = torch.where(found, torch.where(at_min, state["at_n"], state["below_n"]), n)
    # Σ d² of the kept tokens from the same sums: below the cut h = Σ (d² − τ)
    at_value = _value(prefix, width, dtype)[0].to(torch.float64)
    kept_sum = torch.where(
        found,
        torch.where(at_min, state["at_n"] * at_value, state["below_g"] + tau * state["below_n"]),
        state["total"] + tau * n,
    )
    metrics = {
        "m2po_cut": torch.where(found & (n > 0), at_value, math.inf).to(dtype),
        "m2po_m2": ((state["total"] + tau * n) / n.clamp_min(1)).to(dtype),
        "m2po_m2_kept": (kept_sum / kept_n.clamp_min(1)).to(dtype),
        "m2po_masked_fraction": ((n - kept_n) / n.clamp_min(1)).to(dtype),
    }
    return keep_out, metrics


# --------------------------------------------------------------------------- entropy quantile
@fails_together()
def top_entropy_mask(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    *,
    rho: float,
    group: Group = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Keep the tokens in the top ``rho`` entropy quantile of the batch (every rank of ``group``):
    ``mask and H ≥ torch.quantile(H[mask], 1 − rho)``, ties kept (TRL's ``top_entropy_quantile``;
    https://arxiv.org/abs/2506.01939).

    Args:
        entropy, mask: ``[B, T]`` per-token entropies and 0/1 action mask.
        rho: in ``[0, 1]``, the fraction of the tokens to keep (the paper uses 0.2).
        group: the data-parallel group sharing the batch (None: this process only).

    Returns:
        ``(keep, metrics)``: ``[B, T]`` bool; ``entropy_threshold``, ``entropy_kept_fraction``.

    Example:
        >>> import torch
        >>> h = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
        >>> m = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
        >>> top_entropy_mask(h, m, rho=0.2)[0].nonzero().tolist()  # 0.9 and 1.0 of 10 tokens
        [[1, 2], [1, 3]]
    """
    check_2d("entropy", entropy)
    keep = as_bool_mask("mask", mask, entropy.shape, "entropy", entropy)
    rho = check_nonneg("rho", rho)
    if rho > 1:
        raise ValueError(f"rho must be in [0, 1] (a fraction of the tokens), got {rho}")
    group_rank_size(group)
    dtype = compute_dtype(entropy.dtype)
    h = entropy.detach().to(dtype)
    level = 1.0 - rho
    state: dict[str, torch.Tensor] = {}

    def choose(r: int, hist: torch.Tensor) -> torch.Tensor:
        count = hist[0]  # [2, 256]
        if r == 0:
            n = count[0].sum()
            p = level * (n.to(dtype) - 1).clamp_min(0)
            lo = p.floor()
            state.update(
                n=n,
                frac=p - lo,
                rank=torch.stack([lo, p.ceil()]).to(torch.float64),
                below=count.new_zeros(2),
            )
        c_end = state["below"][:, None] + count.cumsum(-1)
        digit = (c_end <= state["rank"][:, None]).sum(-1).clamp_max(_BINS - 1)
        pick = digit[:, None]
        state["below"] = (c_end.gather(1, pick) - count.gather(1, pick))[:, 0]
        return digit

    call = Call("top_entropy_mask", rho=rho, dtype=dtype)
    prefix, width = _rounds(torch.where(keep, h, 0), keep, [], 2, group, call, choose)
    v_lo, v_hi = _value(prefix, width, dtype).unbind()
    q = torch.lerp(v_lo, v_hi, state["frac"].to(dtype))  # torch.quantile's interpolation
    n = state["n"]
    q = torch.where(n > 0, q, 0)
    keep_out = keep & (h >= q) & (n > 0)
    # tokens >= q: all but those below v_lo (q == v_lo) or below v_hi (q > v_lo)
    below = torch.where(q > v_lo, state["below"][1], state["below"][0])
    metrics = {
        "entropy_kept_fraction": ((n - below) / n.clamp_min(1)).to(dtype),
        "entropy_threshold": q,
    }
    return keep_out, metrics


# --------------------------------------------------------------------------- behaviour weights
@fails_together()
def behavior_importance_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    upper: float,
    lower: float | None = None,
    level: str = "token",
    agg: str = "mean",
    action: str = "mask",
    group: Group = None,
    cp_group: Group = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """AReaL's behaviour importance weight ``π_prox / π_behav`` (``apply_rejection_sampling``),
    ``d = old_logp − rollout_logp``: statistic ``exp(d_t)`` (``level="token"``) or ``exp`` of the
    row's ``agg`` of ``d``, weight ``exp(d_t)`` or ``exp(mean d)``; outside ``[lower, upper]``,
    ``action="mask"`` drops the token (row), ``"clamp"`` clamps its weight.

    Args:
        old_logp, rollout_logp, mask: ``[B, T]`` trainer (proximal) and behaviour log-probs, mask.
        upper, lower: the bounds, ``upper > 0``, ``lower`` in ``(0, upper]`` or None.
        level, agg, action: as above.
        group, cp_group: the data-parallel and context-parallel groups.

    Returns:
        ``(weights, keep, metrics)``: ``behave_filtered_fraction``, ``behave_imp_weight_mean``.

    Example:
        >>> import torch
        >>> rollout = torch.tensor([[0.0, -1.0], [0.1, -0.1]])  # row 0's largest ratio e > 2
        >>> behavior_importance_weights(torch.zeros(2, 2), rollout, torch.ones(2, 2), upper=2.0,
        ...                             level="sequence", agg="max")[1][:, 0]
        tensor([False,  True])
    """
    check_2d("old_logp", old_logp)
    check_same_shape("old_logp", old_logp, rollout_logp=rollout_logp)
    base = as_bool_mask("mask", mask, old_logp.shape, "old_logp", old_logp)
    low, up = check_bounds("upper", upper, "lower", lower)
    level = check_choice("level", level, BEHAVIOR_LEVELS)
    agg = check_choice("agg", agg, BEHAVIOR_AGGS)
    action = check_choice("action", action, BEHAVIOR_ACTIONS)
    mode = "mask" if action == "mask" else "truncate"

    def weights(lvl: str, how: str, high: float, bottom: float | None = None):
        return rollout_importance_weights(
            old_logp,
            rollout_logp,
            mask,
            level=lvl,
            mode=how,
            threshold=high,
            low=bottom,
            cp_group=cp_group,
        )

    if level == "token" or agg == "mean":
        lvl = "token" if level == "token" else "geometric"
        w, keep, m = weights(lvl, mode, up, low)
        if action == "clamp":  # the clamped tokens: those whose statistic is out of bounds
            out = m["rollout_is_ratio_fraction_high"] + m["rollout_is_ratio_fraction_low"]
            n_changed = out.to(torch.float64) * base.sum()
        else:
            n_changed = (base & ~keep).sum()
    else:
        raw, _, _ = weights("geometric", "truncate", math.inf)
        if agg == "sum":
            _, inside, _ = weights("sequence", "mask", up, low)
            inside_row = inside.any(-1)
        else:
            inside_row = _row_max_in_bounds(old_logp, rollout_logp, base, low, up, cp_group)
        inside = base & inside_row[:, None]
        if action == "mask":
            keep, w = inside, torch.where(inside, raw, 0)
        else:
            keep = base
            w = torch.where(inside, raw, raw.clamp(0.0 if low is None else low, up))
            w = torch.where(base, w, 0)
        n_changed = (base & ((w != raw) if action == "clamp" else ~keep)).sum()
    dtype = w.dtype
    sums = torch.stack([base.sum(), n_changed, keep.sum()]).to(torch.float64)
    sums = torch.cat([sums, w.to(torch.float64).sum().reshape(1)])
    if group is not None:
        call = Call(
            "behavior_importance_weights", level=level, agg=agg, action=action, upper=up, lower=low
        )
        sums = gather(sums, group, call).sum(0)
    metrics = {
        "behave_filtered_fraction": (sums[1] / sums[0].clamp_min(1)).to(dtype),
        "behave_imp_weight_mean": (sums[3] / sums[2].clamp_min(1)).to(dtype),
    }
    return w, keep, metrics


def _row_max_in_bounds(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    keep: torch.Tensor,
    low: float | None,
    up: float,
    cp_group: Group,
) -> torch.Tensor:
    """``[B]``: whether the row's largest ``d`` (over ``cp_group``) is within the log bounds."""
    dtype = compute_dtype(torch.promote_types(old_logp.dtype, rollout_logp.dtype))
    d = old_logp.detach().to(dtype) - rollout_logp.detach().to(dtype)
    if d.shape[-1] == 0:
        top = d.new_full(d.shape[:-1], -math.inf)
    else:
        top = torch.where(keep, d, -math.inf).amax(-1)
    if group_rank_size(cp_group, "cp_group")[1] > 1:
        call = Call("behavior_importance_weights", agg="max", upper=up, lower=low)
        top = gather(top[:, None], cp_group, call, "cp_group").amax(0)[:, 0].to(dtype)
    lo = -math.inf if low is None else math.log(low)
    empty = top == -math.inf
    return empty | ((top >= lo) & (top <= math.log(up)))
