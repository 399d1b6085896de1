"""verl's KL-coefficient controllers: β (``.value``) fixed or adapted by ``update(current_kl,
n_steps)`` after each batch (a device tensor is not read: docs/design/losses.md)."""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping

import torch

from rlops._checks import (
    as_int,
    as_real,
    as_real_or_tensor,
    check_choice,
    check_finite_positive,
    check_nonneg,
    check_positive,
    values_checked,
)

__all__ = [
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


def _current_kl(current_kl: object, read: bool = True) -> float | torch.Tensor:
    """``current_kl`` checked: a float, or a 0-dim tensor on its device (or unread)."""
    kl = as_real_or_tensor("current_kl", current_kl)
    if not isinstance(kl, torch.Tensor) or not read:
        return kl
    if _on_device(kl):
        return kl.to(torch.float64 if kl.device.type != "mps" else torch.float32)
    return as_real("current_kl", kl)


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
