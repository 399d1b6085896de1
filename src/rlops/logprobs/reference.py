"""The unfused reference: ``log_softmax`` + gather for log-probs, softmax · log_softmax for entropy.

Plain PyTorch on the full vocabulary in one process, materialising every ``[..., V]``
intermediate, the sampler's support included (:func:`sampler_keep_mask`: each filter stated on
the sorted vocabulary). It defines the semantics the fused ops must match (tests) and is the
baseline they are measured against (benchmarks). Not exported from :mod:`rlops`.
"""

from __future__ import annotations

import torch
from typing_extensions import Unpack  # torch's own dependency (typing.Unpack: 3.11+)

from rlops._checks import compute_dtype
from rlops.logprobs._options import ReferenceOptions

__all__ = [
    "linear_logprobs_and_entropy_reference",
    "logprobs_and_entropy_reference",
    "sampler_keep_mask",
]


def _per_token(p: int | float | torch.Tensor, z: torch.Tensor) -> int | float | torch.Tensor:
    """A scalar as it is; a per-token tensor ``[...]`` as ``[..., 1]`` beside ``z [..., V]``."""
    return p.to(z.device).unsqueeze(-1) if isinstance(p, torch.Tensor) else p


def sampler_keep_mask(
    z: torch.Tensor,
    *,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """``[..., V]`` bool: the sampler's support of the scaled logits ``z`` ``[..., V]``.

    The filters in vLLM's order, each on what the previous ones kept (``p = softmax(z)``):

    - min-p keeps ``p_v ≥ min_p · max_u p_u``, i.e. ``exp(z_v − max z) ≥ min_p``;
    - top-k keeps every logit ``≥`` the k-th largest kept value (ties with it kept too);
    - top-p sorts the kept logits descending, renormalises their probabilities, and keeps the
      smallest prefix whose mass reaches ``top_p`` (the token at which the mass before it is
      still ``< top_p`` is the last kept), and every logit tied with its value; ``top_p = 1``
      keeps everything.

    Each parameter is a scalar or a per-token tensor ``[...]``; None leaves that filter off.
    The target is not part of this mask (the log-prob ops always keep it).

    Example:
        >>> import torch
        >>> z = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
        >>> sampler_keep_mask(z, top_k=2)  # the tie with the 2nd value is kept
        tensor([[ True,  True,  True, False]])
    """
    inf = float("-inf")
    keep = torch.ones_like(z, dtype=torch.bool)
    if min_p is not None:
        keep &= torch.exp(z - z.amax(dim=-1, keepdim=True)) >= _per_token(min_p, z)
    if top_k is not None:
        desc = z.masked_fill(~keep, inf).sort(dim=-1, descending=True).values
        k = top_k if isinstance(top_k, torch.Tensor) else torch.tensor(top_k)
        k = k.to(z.device).expand(z.shape[:-1]).clamp(1, z.shape[-1])
        keep &= z >= desc.gather(-1, k.unsqueeze(-1) - 1)
    if top_p is not None:
        desc = z.masked_fill(~keep, inf).sort(dim=-1, descending=True).values
        q = torch.softmax(desc, dim=-1)
        before = torch.zeros_like(q)  # the mass strictly before each sorted position
        before[..., 1:] = torch.cumsum(q[..., :-1], dim=-1)
        last = (before < _per_token(top_p, z)).sum(dim=-1, keepdim=True) - 1
        t_p = desc.gather(-1, last.clamp(min=0))
        everything = torch.as_tensor(top_p, device=z.device).unsqueeze(-1) >= 1.0
        keep &= (z >= t_p) | everything
    return keep


def logprobs_and_entropy_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    logit_scale: float = 1.0,
    final_logit_softcapping: float | None = None,
    keep_mask: torch.Tensor | None = None,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    entropy_over_support: bool = False,
    with_entropy: bool = True,
    with_sum_pi_squared: bool = False,
) -> (
    tuple[torch.Tensor, torch.Tensor | None]
    | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]
):
    """Reference log-probs and entropy over the full vocabulary ``[..., V]``.

    ``z = logits / temperature`` in float32 (float64 stays float64; a ``[N]`` (``[B]``)
    temperature: one per row of the first dim), after Hugging Face's head
    maps: ``x = logits · logit_scale``, then with ``final_logit_softcapping = c``
    ``x = c · tanh(x / c)``; the support ``K`` is
    ``keep_mask``, or the sampler's (:func:`sampler_keep_mask` on ``z``, in that dtype), and
    always holds the target;
    ``logp = log_softmax(z masked to K).gather(target)``;
    ``entropy = −(softmax(z) · log_softmax(z)).sum(−1)`` over the unmasked logits, or over
    ``K`` with ``entropy_over_support=True``; with ``with_sum_pi_squared=True`` a third output
    ``(p ** 2).sum(−1)``, ``p = softmax(z masked to K)`` (the log-prob's distribution), detached.

    Example:
        >>> import torch
        >>> logp, ent = logprobs_and_entropy_reference(torch.zeros(1, 4), torch.tensor([2]))
        >>> logp, ent
        (tensor([-1.3863]), tensor([1.3863]))
        >>> logprobs_and_entropy_reference(  # top-2 of four equal logits keeps all four
        ...     torch.zeros(1, 4), torch.tensor([2]), top_k=2, with_entropy=False)[0]
        tensor([-1.3863])
    """
    x = logits.to(compute_dtype(logits.dtype))
    if logit_scale != 1.0:
        x = x * logit_scale
    if final_logit_softcapping is not None:
        x = final_logit_softcapping * torch.tanh(x / final_logit_softcapping)
    if isinstance(temperature, torch.Tensor):  # one per row of the first dim
        temperature = temperature.to(x.dtype).reshape(-1, *[1] * (x.dim() - 1))
    z = x / temperature
    idx = target.long().unsqueeze(-1)
    if top_k is not None or top_p is not None or min_p is not None:
        if keep_mask is not None:
            raise ValueError("give the support either as keep_mask or as top_k / top_p / min_p")
        keep_mask = sampler_keep_mask(z.detach(), top_k=top_k, top_p=top_p, min_p=min_p)
    if entropy_over_support and keep_mask is None:
        raise ValueError("entropy_over_support=True needs keep_mask, top_k, top_p or min_p")
    zk = z
    keep = None
    if keep_mask is not None:
        keep = keep_mask.scatter(-1, idx, True)
        zk = z.masked_fill(~keep, float("-inf"))
    log_pk = torch.log_softmax(zk, dim=-1)
    logp = log_pk.gather(-1, idx).squeeze(-1)
    ent = None
    if with_entropy and entropy_over_support and keep is not None:
        ent = -(torch.softmax(zk, dim=-1) * log_pk.masked_fill(~keep, 0.0)).sum(dim=-1)
    elif with_entropy:
        ent = -(torch.softmax(z, dim=-1) * torch.log_softmax(z, dim=-1)).sum(dim=-1)
    if not with_sum_pi_squared:
        return logp, ent
    p = torch.softmax(zk.detach(), dim=-1)
    return logp, ent, (p**2).sum(dim=-1)


def linear_logprobs_and_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    **options: Unpack[ReferenceOptions],
) -> (
    tuple[torch.Tensor, torch.Tensor | None]
    | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]
):
    """The reference on materialised logits: ``F.linear(hidden [N, H], weight [V, H], bias
    [V])``, ``hidden @ weightᵀ + bias``, in their dtype; the keyword ``options`` are
    :func:`logprobs_and_entropy_reference`'s.

    Example:
        >>> import torch
        >>> logp, _ = linear_logprobs_and_entropy_reference(
        ...     torch.ones(1, 2), torch.zeros(3, 2), torch.tensor([0]), with_entropy=False)
        >>> logp
        tensor([-1.0986])
    """
    return logprobs_and_entropy_reference(
        torch.nn.functional.linear(hidden, weight, bias), target, **options
    )
