"""verl's KL-coefficient controllers: β (``.value``) fixed or adapted by ``update(current_kl,
n_steps)`` after each batch; TRL's adaptive entropy coefficient, ``update(entropy)`` after each
optimizer step (a device tensor is not read: docs/design/losses.md)."""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping
from typing import cast

import torch

from rlops._checks import (
    as_int,
    as_real,
    as_real_or_tensor,
    check_choice,
    check_finite_positive,
    check_nonneg,
    check_positive,
    check_real,
    is_finite,
    values_checked,
)

__all__ = [
    "AdaptiveEntropyController",
    "AdaptiveKLController",
    "FixedKLController",
    "get_kl_controller",
    "kl_controller",
]

#: the clip of the proportional error, as in Ziegler et al. and verl
_CLIP = 0.2


def _on_device(t: torch.Tensor) -> bool:
    """Whether a ``current_kl`` tensor is kept on its device rather than read as a number."""
    return t.device.type != "cpu"


def _current_kl(
    current_kl: object, read: bool = True, name: str = "current_kl"
) -> float | torch.Tensor:
    """``current_kl`` checked: a float, or a 0-dim tensor on its device (or unread)."""
    kl = as_real_or_tensor(name, current_kl)
    if not isinstance(kl, torch.Tensor) or not read:
        return kl
    if _on_device(kl):
        return kl.to(torch.float64 if kl.device.type != "mps" else torch.float32)
    return as_real(name, kl)


class FixedKLController:
    """A constant KL coefficient β (``.value``, ``kl_coef >= 0``); ``update`` changes nothing.

    Example:
        >>> ctrl = FixedKLController(0.05)
        >>> ctrl.update(3.0, n_steps=256); ctrl.value
        0.05
    """

    def __init__(self, kl_coef: float) -> None:
        self.value: float | torch.Tensor = check_nonneg("kl_coef", kl_coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """No-op (verl's); ``current_kl`` is not read."""
        _current_kl(current_kl, read=False)
        as_int("n_steps", n_steps, minimum=0, tensor=False)

    def __repr__(self) -> str:
        return f"FixedKLController(kl_coef={self.value})"


class AdaptiveKLController:
    """β driven towards a target KL (https://arxiv.org/abs/1909.08593, §2.2): each ``update``::

        e     = clip(current_kl / target − 1, −0.2, 0.2)
        value = value · (1 + e · n_steps / horizon)

    Args:
        init_kl_coef: ``>= 0``, the initial β.
        target_kl: ``> 0`` and finite.
        horizon: ``> 0``, the samples over which an error is corrected (verl's 10000).

    Example:
        >>> ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=1.0, horizon=100)
        >>> ctrl.update(1.5, n_steps=50); ctrl.value  # e = 0.5 clipped to 0.2: × 1.1
        0.55
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        self.value: float | torch.Tensor = check_nonneg("init_kl_coef", init_kl_coef)
        self.target = check_finite_positive("target_kl", target_kl)
        self.horizon = check_positive("horizon", horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Scale ``.value`` by ``1 + e·n_steps/horizon`` (``n_steps``: the batch's samples)."""
        kl = _current_kl(current_kl)
        n = as_int("n_steps", n_steps, minimum=0, tensor=False)
        error: float | torch.Tensor
        if isinstance(kl, torch.Tensor):
            if isinstance(self.value, torch.Tensor) and self.value.device != kl.device:
                raise ValueError(
                    f"current_kl is on {kl.device} but the coefficient is on "
                    f"{self.value.device}; pass the KL of one device"
                )
            if values_checked(kl) and bool(kl.isnan()):
                raise ValueError("current_kl must not be NaN")
            error = (kl / self.target - 1).clamp(-_CLIP, _CLIP)
        else:
            if math.isnan(kl):
                raise ValueError(f"current_kl must not be NaN, got {current_kl}")
            error = min(max(kl / self.target - 1, -_CLIP), _CLIP)
        self.value = self.value * (1 + error * n / self.horizon)

    def __repr__(self) -> str:
        return (
            f"AdaptiveKLController(value={self.value}, target_kl={self.target}, "
            f"horizon={self.horizon})"
        )


class AdaptiveEntropyController:
    """Skywork-OR1's adaptive entropy coefficient (https://arxiv.org/abs/2505.22312), as TRL's
    ``GRPOTrainer`` applies it (``use_adaptive_entropy``; names and defaults of ``GRPOConfig``).

    Each ``update(entropy)``, at an optimizer step's end, with ``H`` the step's mean per-token
    entropy over the loss's tokens (all ranks)::

        entropy_coef = min(entropy_coef + entropy_coef_delta, entropy_coef_max)   if H <= target
                       max(entropy_coef − entropy_coef_delta, entropy_coef_min)   otherwise
        value        = entropy_coef if H <= target else 0    (0 before the first update)

    ``value`` is the coefficient of the next step's bonus, ``loss − value·H`` (TRL's gating: the
    coefficient adapts all along, and acts only while the entropy is at or below the target).
    ``entropy`` is the last ``H`` (TRL's ``_last_world_entropy``, ``inf`` at first).

    Args:
        entropy_coef: the initial coefficient (finite; TRL starts it at its ``entropy_coef``
            and clamps it into the bounds at the first update only).
        entropy_target: the target mean entropy in nats (not NaN).
        entropy_coef_delta: the step, finite ``>= 0``.
        entropy_coef_min, entropy_coef_max: the bounds, ``min <= max`` (not NaN).

    ``update`` takes a float or a 0-dim tensor: an accelerator's is not read, and ``.value``
    and ``.entropy_coef`` become 0-dim tensors on its device; a NaN entropy raises where it is
    read (TRL's would count as above the target).

    Example:
        >>> ctrl = AdaptiveEntropyController(entropy_coef=0.01, entropy_target=0.5)
        >>> ctrl.value  # no entropy measured yet
        0.0
        >>> ctrl.update(0.3); round(ctrl.value, 6)  # below the target: raised and applied
        0.015
        >>> ctrl.update(0.9); ctrl.value, round(ctrl.entropy_coef, 6)  # above: lowered, off
        (0.0, 0.01)
    """

    def __init__(
        self,
        entropy_coef: float = 0.0,
        entropy_target: float = 0.2,
        entropy_coef_delta: float = 0.005,
        entropy_coef_min: float = 0.0,
        entropy_coef_max: float = 1.0,
    ) -> None:
        coef = as_real("entropy_coef", entropy_coef)
        if not is_finite(coef):
            raise ValueError(f"entropy_coef must be a finite number, got {entropy_coef}")
        self.entropy_coef: float | torch.Tensor = coef
        self.entropy_target = check_real("entropy_target", entropy_target)
        self.entropy_coef_delta = check_nonneg("entropy_coef_delta", entropy_coef_delta)
        self.entropy_coef_min = check_real("entropy_coef_min", entropy_coef_min)
        self.entropy_coef_max = check_real("entropy_coef_max", entropy_coef_max)
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(
                "entropy_coef_min must be <= entropy_coef_max, got entropy_coef_min="
                f"{entropy_coef_min} > entropy_coef_max={entropy_coef_max}"
            )
        self.entropy: float | torch.Tensor = math.inf

    @property
    def value(self) -> float | torch.Tensor:
        """The coefficient to apply now: ``entropy_coef`` if the last entropy was at or below
        the target, else 0."""
        if isinstance(self.entropy, torch.Tensor):
            return torch.where(self.entropy <= self.entropy_target, self.entropy_coef, 0.0)
        return self.entropy_coef if self.entropy <= self.entropy_target else 0.0

    def update(self, entropy: float | torch.Tensor) -> None:
        """Move ``entropy_coef`` one ``entropy_coef_delta`` towards the target's side (the
        formula above), and keep ``entropy`` for :attr:`value`."""
        h = _current_kl(entropy, name="entropy")
        coef = self.entropy_coef
        if isinstance(h, torch.Tensor) or isinstance(coef, torch.Tensor):
            self._update_on_device(h, coef)
            return
        if math.isnan(h):
            raise ValueError(f"entropy must not be NaN, got {entropy}")
        delta = self.entropy_coef_delta
        if h <= self.entropy_target:  # TRL's two expressions, in Python floats as TRL's
            self.entropy_coef = min(coef + delta, self.entropy_coef_max)
        else:
            self.entropy_coef = max(coef - delta, self.entropy_coef_min)
        self.entropy = h

    def _update_on_device(self, h: float | torch.Tensor, coef: float | torch.Tensor) -> None:
        """:meth:`update` with 0-dim tensors on the entropy's (or coefficient's) device."""
        device = h.device if isinstance(h, torch.Tensor) else cast(torch.Tensor, coef).device
        if isinstance(coef, torch.Tensor) and coef.device != device:
            raise ValueError(
                f"entropy is on {device} but the coefficient is on {coef.device}; pass the "
                "entropy of one device"
            )
        dtype = torch.float64 if device.type != "mps" else torch.float32
        h_t = torch.as_tensor(h, dtype=dtype, device=device)
        if values_checked(h_t) and bool(h_t.isnan()):
            raise ValueError("entropy must not be NaN")
        c, delta = torch.as_tensor(coef, dtype=dtype, device=device), self.entropy_coef_delta
        up = (c + delta).clamp(max=self.entropy_coef_max)
        down = (c - delta).clamp(min=self.entropy_coef_min)
        self.entropy_coef = torch.where(h_t <= self.entropy_target, up, down)
        self.entropy = h_t

    def __repr__(self) -> str:
        return (
            f"AdaptiveEntropyController(entropy_coef={self.entropy_coef}, "
            f"entropy_target={self.entropy_target}, "
            f"entropy_coef_delta={self.entropy_coef_delta}, "
            f"entropy_coef_min={self.entropy_coef_min}, entropy_coef_max={self.entropy_coef_max})"
        )


#: verl's ``KLControlConfig`` defaults (``verl/trainer/config/algorithm.py``)
_KL_CTRL_DEFAULTS = {"type": "fixed", "kl_coef": 0.001, "target_kl": 0.1, "horizon": 10000}


def _setting(kl_ctrl: object, key: str) -> object:
    """``kl_ctrl[key]`` for a mapping, ``kl_ctrl.key`` for an object, else verl's default."""
    if isinstance(kl_ctrl, Mapping):
        return kl_ctrl.get(key, _KL_CTRL_DEFAULTS[key])
    return getattr(kl_ctrl, key, _KL_CTRL_DEFAULTS[key])


def get_kl_controller(kl_ctrl: object) -> FixedKLController | AdaptiveKLController:
    """verl's ``get_kl_controller`` of ``algorithm.kl_ctrl`` (an object or a mapping with ``type``,
    ``kl_coef``, ``target_kl``, ``horizon``; a missing key takes verl's default): a
    :class:`FixedKLController` or an :class:`AdaptiveKLController`.

    Raises:
        ValueError: an unknown ``type`` or a setting out of range, naming ``kl_ctrl.<key>``.

    Example:
        >>> get_kl_controller({"type": "adaptive", "kl_coef": 0.2, "target_kl": 6.0})
        AdaptiveKLController(value=0.2, target_kl=6.0, horizon=10000.0)
    """
    if kl_ctrl is None or isinstance(kl_ctrl, (str, bytes, numbers.Number)):
        raise TypeError(
            "kl_ctrl must be a config with type, kl_coef, target_kl and horizon (verl's "
            f"KLControlConfig, an object or a mapping), got {type(kl_ctrl).__name__}"
        )
    kind = _setting(kl_ctrl, "type")
    check_choice("kl_ctrl.type", kind, ("fixed", "adaptive"))
    kl_coef = _setting(kl_ctrl, "kl_coef")
    if kind == "fixed":
        return FixedKLController(check_nonneg("kl_ctrl.kl_coef", kl_coef))
    return AdaptiveKLController(
        init_kl_coef=check_nonneg("kl_ctrl.kl_coef", kl_coef),
        target_kl=check_finite_positive("kl_ctrl.target_kl", _setting(kl_ctrl, "target_kl")),
        horizon=check_positive("kl_ctrl.horizon", _setting(kl_ctrl, "horizon")),
    )


def kl_controller(
    kind: str,
    *,
    kl_coef: float = 0.001,
    target_kl: float = 0.1,
    horizon: float = 10000,
) -> FixedKLController | AdaptiveKLController:
    """Deprecated (a ``DeprecationWarning``): :func:`get_kl_controller` of ``{"type": kind, ...}``.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", DeprecationWarning)
        ...     kl_controller("adaptive", kl_coef=0.2, target_kl=6.0, horizon=10000)
        AdaptiveKLController(value=0.2, target_kl=6.0, horizon=10000.0)
    """
    warnings.warn(
        "rlops.kl_controllers.kl_controller(kind, kl_coef=...) is deprecated: use "
        "get_kl_controller({'type': kind, 'kl_coef': ..., 'target_kl': ..., 'horizon': ...}) "
        "(verl's factory) or AdaptiveKLController(init_kl_coef, target_kl, horizon)",
        DeprecationWarning,
        stacklevel=2,
    )
    check_choice("kind", kind, ("fixed", "adaptive"))
    if kind == "fixed":
        return FixedKLController(kl_coef)
    return AdaptiveKLController(kl_coef, target_kl, horizon)
