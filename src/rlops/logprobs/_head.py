"""The output head's elementwise map before the softmax: logit scale, final softcap, temperature.

For the logits ``x`` of the output layer (in the compute dtype, float32 or float64), in the
order of Hugging Face transformers (Cohere's ``logits * logit_scale``, Granite's
``logits / logits_scaling`` as ``logit_scale = 1 / logits_scaling``, then Gemma-2/3's
``final_logit_softcapping``) and of TRL's chunked head, then the sampler's temperature:

    u = x · s,    u ← c · tanh(u / c)  (with ``final_logit_softcapping = c``),    z = u / τ,

and ``∂z/∂x = s · (1 − tanh²(x·s / c)) / τ`` (``s / τ`` without a softcap). With ``s = 1`` and
no softcap nothing is computed beyond the division by ``τ``: the bits of the op without them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlops._checks import check_logit_scale, check_softcap

__all__ = ["Head", "check_logit_scale", "check_softcap"]


@dataclass(frozen=True)
class Head:
    """The map ``x → z`` above: ``temperature`` τ, ``logit_scale`` s, ``softcap`` c (None: off)."""

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        """Only the temperature: ``z = x / τ``."""
        return self.logit_scale == 1.0 and self.softcap is None

    @property
    def grad_scale(self) -> float:
        """``∂z/∂x`` where it is a constant (no softcap): ``s / τ`` (``1 / τ`` when ``s = 1``);
        with a softcap ``1 / τ``, the rest of the slope being :meth:`sloped`'s."""
        if self.logit_scale == 1.0 or self.softcap is not None:
            return 1.0 / self.temperature
        return self.logit_scale / self.temperature

    def scaled(self, x: torch.Tensor, dtype: torch.dtype, own: bool) -> tuple[torch.Tensor, bool]:
        """``(z in dtype, own)``; ``own`` (argument): ``x`` is a fresh buffer that may be
        overwritten; (result): ``z`` is one (not ``x``'s storage when ``x`` was not)."""
        if x.dtype != dtype:
            x, own = x.to(dtype), True
        tau = self.temperature
        if self.plain:
            if tau == 1.0:
                return x, own
            return (x.div_(tau) if own else torch.div(x, tau)), True
        z = x if own else x.clone()
        if self.logit_scale != 1.0:
            z.mul_(self.logit_scale)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        if tau != 1.0:
            z.div_(tau)
        return z, True

    def sloped(
        self, x: torch.Tensor, dtype: torch.dtype, own: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With a softcap: ``(z, slope)``, ``z`` a fresh buffer with :meth:`scaled`'s bits and
        ``slope = s · (1 − tanh²(x·s / c))`` ``[C, V]`` (``τ · ∂z/∂x``)."""
        if self.softcap is None:
            raise ValueError("Head.sloped needs a softcap (else the slope is grad_scale)")
        t = x.to(dtype, copy=not own)
        if self.logit_scale != 1.0:
            t.mul_(self.logit_scale)
        t.div_(self.softcap).tanh_()
        z = t * self.softcap
        if self.temperature != 1.0:
            z.div_(self.temperature)
        slope = t.mul_(t).neg_().add_(1.0)
        if self.logit_scale != 1.0:
            slope.mul_(self.logit_scale)
        return z, slope

    def differentiable(self, x: torch.Tensor) -> torch.Tensor:
        """``z`` from ``x`` (compute dtype) with out-of-place ops (a graph for double backward)."""
        z = x * self.logit_scale if self.logit_scale != 1.0 else x
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z / self.temperature
