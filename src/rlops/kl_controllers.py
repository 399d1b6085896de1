"""Controllers of the KL-penalty coefficient β: fixed, or adapted towards a target KL.

Small state objects with verl's names, arguments and meanings (``FixedKLController(kl_coef)``,
``AdaptiveKLController(init_kl_coef, target_kl, horizon)`` and the factory
``get_kl_controller(kl_ctrl)`` of ``verl/trainer/ppo/core_algos.py``, which reads verl's
``algorithm.kl_ctrl`` settings ``type``, ``kl_coef``, ``target_kl``, ``horizon``): the
coefficient is ``.value``; after each batch the trainer calls ``update(current_kl, n_steps)``
with the batch's mean KL and its number of samples.

Both inputs of ``update`` are constants, never part of an autograd graph: ``current_kl`` is
read as a number (a tensor is detached first, and one on an accelerator stays there, detached),
``n_steps`` must be an integer, and ``.value`` never requires a gradient.

The adaptive rule is Ziegler et al.'s proportional controller
(https://arxiv.org/abs/1909.08593, section 2.2)::

    e     = clip(KL / target − 1, −0.2, 0.2)
    β    ←  β · (1 + e · n_steps / horizon)

``current_kl`` may be a Python or numpy number, or a 0-dim tensor. A tensor on the CPU is read
(no device synchronisation) and ``.value`` stays a Python float, as in verl. A tensor on an
accelerator is *not* read: ``.value`` becomes a 0-dim float64 tensor on that device (float32 on
MPS), computed there, so a trainer can apply the penalty ``β·kl`` and update β every step
without waiting for the device; ``float(ctrl.value)`` reads it when it is logged. From then on
``.value`` stays a tensor on that device (Python numbers still update it).
"""

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
    """``current_kl`` checked: returned as a float, or as a detached 0-dim tensor when it lives
    on a device (or when ``read`` is False, as the fixed controller never needs its value)."""
    kl = as_real_or_tensor("current_kl", current_kl)
    if not isinstance(kl, torch.Tensor) or not read:
        return kl
    if _on_device(kl):
        return kl.to(torch.float64 if kl.device.type != "mps" else torch.float32)
    return as_real("current_kl", kl)


class FixedKLController:
    """A constant KL coefficient: ``update`` checks its arguments and changes nothing.

    Args:
        kl_coef: ``>= 0``, the coefficient β, kept as ``.value``.

    Example:
        >>> ctrl = FixedKLController(0.05)
        >>> ctrl.update(3.0, n_steps=256)
        >>> ctrl.value
        0.05
    """

    def __init__(self, kl_coef: float) -> None:
        self.value: float | torch.Tensor = check_nonneg("kl_coef", kl_coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """No-op (verl's): ``current_kl`` (a number or 0-dim tensor) is not read."""
        _current_kl(current_kl, read=False)
        as_int("n_steps", n_steps, minimum=0, tensor=False)

    def __repr__(self) -> str:
        return f"FixedKLController(kl_coef={self.value})"


class AdaptiveKLController:
    """A KL coefficient driven towards a target KL (Ziegler et al., 2019).

    Each ``update(current_kl, n_steps)``::

        e     = clip(current_kl / target − 1, −0.2, 0.2)
        value = value · (1 + e · n_steps / horizon)

    so β grows by up to ``0.2·n_steps/horizon`` while the KL is above the target and shrinks
    while it is below. (A batch of more than ``5·horizon`` samples below the target would make
    the factor negative; verl does not guard against it and neither does this class.)
    https://arxiv.org/abs/1909.08593

    Args:
        init_kl_coef: ``>= 0``, the initial β (``.value``).
        target_kl: ``> 0`` and finite, the KL aimed at (``.target``).
        horizon: ``> 0``, the number of samples over which a relative error is corrected
            (``.horizon``; verl's default 10000).

    Example:
        >>> ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=1.0, horizon=100)
        >>> ctrl.update(1.5, n_steps=50)  # e = 0.5, clipped to 0.2: × (1 + 0.2·50/100)
        >>> ctrl.value
        0.55
        >>> ctrl.update(0.25, n_steps=50)  # e = −0.75, clipped to −0.2: × 0.9
        >>> round(ctrl.value, 6)
        0.495
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        self.value: float | torch.Tensor = check_nonneg("init_kl_coef", init_kl_coef)
        self.target = check_finite_positive("target_kl", target_kl)
        self.horizon = check_positive("horizon", horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Scale ``.value`` by ``1 + clip(current_kl/target − 1, ±0.2)·n_steps/horizon``.

        ``current_kl``: the batch's KL, a number or a 0-dim tensor (see the module docstring
        for a tensor on an accelerator); NaN is rejected where the value is read.
        ``n_steps``: ``>= 0``, the number of samples in the batch (verl passes the batch size).
        """
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
    """The KL controller of verl's ``algorithm.kl_ctrl`` settings (verl's ``get_kl_controller``).

    ``kl_ctrl.type == "fixed"`` gives ``FixedKLController(kl_coef=kl_ctrl.kl_coef)``;
    ``"adaptive"`` gives ``AdaptiveKLController(init_kl_coef=kl_ctrl.kl_coef,
    target_kl=kl_ctrl.target_kl, horizon=kl_ctrl.horizon)``, which needs ``horizon > 0``. The
    config's ``kl_coef`` is the adaptive controller's *initial* coefficient, as in verl.

    Args:
        kl_ctrl: verl's ``KLControlConfig``, an OmegaConf node, any object with those
            attributes, or a mapping with those keys; a missing one takes verl's default
            (``type="fixed"``, ``kl_coef=0.001``, ``target_kl=0.1``, ``horizon=10000``).

    Returns:
        A ``FixedKLController`` or an ``AdaptiveKLController``.

    Raises:
        ValueError: ``kl_ctrl.type`` is neither ``"fixed"`` nor ``"adaptive"`` (verl:
            ``NotImplementedError``), or a setting is out of range (verl: ``AssertionError``
            for ``horizon <= 0``); each names ``kl_ctrl.<key>``.

    Example:
        >>> get_kl_controller({"type": "adaptive", "kl_coef": 0.2, "target_kl": 6.0})
        AdaptiveKLController(value=0.2, target_kl=6.0, horizon=10000.0)
        >>> get_kl_controller({"kl_coef": 0.05}).value
        0.05
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
    """Deprecated: use :func:`get_kl_controller` (verl's name), or the classes directly.

    ``kl_controller(kind, kl_coef=c, target_kl=t, horizon=h)`` is
    ``get_kl_controller({"type": kind, "kl_coef": c, "target_kl": t, "horizon": h})``: for
    ``kind="adaptive"``, ``AdaptiveKLController(init_kl_coef=c, target_kl=t, horizon=h)``.
    Emits a ``DeprecationWarning``.

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
