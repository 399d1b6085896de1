"""Tensor-parallel consistency check: the group check's one fixed-size exchange, before the
statistics.

Every rank of a vocabulary-parallel call describes what it was asked to compute (a
:class:`rlops.distributed.collectives.Call`: the operation, the number of tokens, the hidden
size and whether a bias is given (linear op), the input dtype, the flags (``with_sum_pi_squared``
among them: it adds a column to the statistics), the temperature, the head's ``logit_scale`` and
``final_logit_softcapping``, the sampler's scalar ``top_k``,
``top_p``, ``min_p`` and ``entropy_over_support``, whether a row ``mask`` and a CSR support
are given) with checksums computed on the device,
compared bit for bit: one of the target ids, of the row mask, of the CSR support's ids and
offsets, and one of each sampler parameter given per token
(:func:`checksum`). The payload is its vocabulary shard size ``V_local``. One
:func:`~rlops.distributed.collectives.exchange` then gives every rank the same
``[world]`` shard sizes, from which it derives its offset in the vocabulary (the sum of the
sizes of the ranks before it) and the full vocabulary size, so shards of unequal size are
merged correctly, or raises the same ``ValueError`` naming what disagrees with each rank's
value, instead of returning wrong log-probs or aborting inside the statistics' collective
(whose size depends on the tokens and the flags). A rank whose own arguments fail the local
checks still joins the exchange (:func:`fail_together`): it raises its own error, the others a
``ValueError`` naming its rejected argument.

Reading the exchanged numbers is a host synchronisation (on accelerators). ``RLOPS_TP_CHECK=0``
(this check only) or ``RLOPS_GROUP_CHECK=0`` (every group check) in every rank's environment
turns it off: exactly one collective per forward remains, nothing is read on the host, and the
shards must then have equal sizes (rank ``r`` holds ids ``[r·V_local, (r+1)·V_local)``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from rlops.distributed import collectives
from rlops.logprobs._support import Sampler

__all__ = ["ENV", "Call", "check_enabled", "checksum", "fail_together", "shard_layout"]

ENV = "RLOPS_TP_CHECK"
_TARGET = "target ids (position-weighted checksum)"
_MASK = "mask (position-weighted checksum)"
_SUPPORT = "support_ids and support_offsets (checksum)"
_PARAMS = ("top_k", "top_p", "min_p")
# A difference in the key implies one in the values: only the key is reported.
_IMPLIED = {
    "tokens": (_TARGET, _MASK, _SUPPORT, *(f"{p} (per-token checksum)" for p in _PARAMS)),
    "mask given": (_MASK,),
    "support_ids given": ("support_ids (nnz)", _SUPPORT),
    "support_ids (nnz)": (_SUPPORT,),
    "function": ("hidden size",),
    **{p: (f"{p} (per-token checksum)",) for p in ("top_k", "top_p", "min_p")},
}


def check_enabled() -> bool:
    """Whether the check runs: neither ``RLOPS_TP_CHECK`` nor ``RLOPS_GROUP_CHECK`` is ``0``."""
    return os.environ.get(ENV, "1") != "0" and collectives.check_enabled()


def checksum(values: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 of a tensor's bits, on its device with no host read, in one pass:
    ``Σ_t (2t + 1) · bits[t]`` modulo ``2**64`` (int64 arithmetic wraps), ``bits`` the values
    as integers (a float's bit pattern, ``-0.0`` as ``0.0``). Integer sums do not depend on
    the order of the additions, so ranks holding the same values get the same number; two
    tensors that differ at a single position always differ here (odd weights are invertible
    modulo ``2**64``); the weights also tell apart the same values in another order."""
    flat = values.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat + 0  # -0.0 + 0 is +0.0: equal values, equal bits
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        flat = flat.view(ints)
    weights = torch.arange(1, 2 * flat.numel() + 1, 2, dtype=torch.int64, device=flat.device)
    return (flat.to(torch.int64) * weights).sum()


@dataclass(frozen=True)
class Call:
    """What one rank was asked to compute: everything that must agree across the group, and
    this rank's shard size ``v_local`` (which need not)."""

    op: str
    v_local: int
    tokens: int
    hidden: int
    dtype: torch.dtype
    with_entropy: bool
    entropy_grad: bool
    masked: bool
    temperature: float
    logit_scale: float = 1.0
    softcap: float | None = None
    sampler: Sampler | None = None
    entropy_over_support: bool = False
    sum_pi_squared: bool = False
    bias: bool = False
    row_mask: torch.Tensor | None = None
    support: tuple[torch.Tensor, torch.Tensor] | None = None

    def described(self, target: torch.Tensor) -> collectives.Call:
        """The group check's description, with the checksums of ``target`` and of the
        sampler's per-token tensors (on their device)."""
        fields: dict[str, object] = {
            "tokens": self.tokens,
            "hidden size": self.hidden,
            "bias given": self.bias,
            "dtype": self.dtype,
            "with_entropy": self.with_entropy,
            "entropy_grad": self.entropy_grad,
            "with_sum_pi_squared": self.sum_pi_squared,
            "keep_mask given": self.masked,
            "temperature": self.temperature,
            "logit_scale": self.logit_scale,
            "final_logit_softcapping": self.softcap,
        }
        params = (
            (None, None, None)
            if self.sampler is None
            else (self.sampler.top_k, self.sampler.top_p, self.sampler.min_p)
        )
        for name, p in zip(("top_k", "top_p", "min_p"), params, strict=True):
            if isinstance(p, torch.Tensor):
                fields[name] = "per token"
                fields[f"{name} (per-token checksum)"] = checksum(p)
            else:
                fields[name] = p
        fields["entropy_over_support"] = self.entropy_over_support
        fields["mask given"] = self.row_mask is not None
        if self.row_mask is not None:
            fields[_MASK] = checksum(self.row_mask.to(torch.int8))
        fields["support_ids given"] = self.support is not None
        if self.support is not None:
            ids, offsets = self.support
            fields["support_ids (nnz)"] = ids.numel()
            fields[_SUPPORT] = checksum(ids.long()) + checksum(offsets.long()) * 3
        fields[_TARGET] = checksum(target)
        return collectives.Call(self.op, implied=_IMPLIED, **fields)


def _fallback_device(group: dist.ProcessGroup) -> torch.device:
    """Where the exchange lives when a rank's own inputs gave no usable device."""
    if "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fail_together(
    group: dist.ProcessGroup, op: str, error: Exception, device: torch.device | None
) -> NoReturn:
    """Join the exchange as a rank of the op named ``op`` whose local checks raised ``error``,
    then raise it. ``device``: where the exchange goes (the inputs' device), or None."""
    dev = device if device is not None else _fallback_device(group)
    payload = torch.zeros(1, dtype=torch.float64, device=dev)
    collectives.exchange(payload, group, collectives.Call(op), failed=error)
    raise error  # exchange raised it already; for the type checker


def shard_layout(
    group: dist.ProcessGroup, rank: int, call: Call, target: torch.Tensor
) -> tuple[int, int]:
    """Exchange the descriptions; return ``(this shard's first id, full vocabulary size)`` or
    raise the same ``ValueError`` on every rank. ``target``: this rank's ids (the device)."""
    payload = torch.tensor([float(call.v_local)], dtype=torch.float64, device=target.device)
    rows = collectives.exchange(payload, group, call.described(target))
    sizes = [int(row[0]) for row in rows]
    return sum(sizes[:rank]), sum(sizes)
