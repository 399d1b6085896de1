"""KL controllers: hand-computed update sequences (Ziegler et al.'s rule), the ±0.2 clip,
numbers and tensors as ``current_kl`` (a device tensor is never read), inputs taken as
constants (no graph), verl's factory and its names, bad input."""

from __future__ import annotations

import dataclasses
import math
import warnings
from types import SimpleNamespace

import pytest
import torch

import rlops
import rlops.losses.kl_controllers as klc
from rlops.losses.kl_controllers import (
    AdaptiveKLController,
    FixedKLController,
    get_kl_controller,
    kl_controller,
)


def ziegler(value, target, horizon, steps):
    """The definition, one line per update: e = clip(KL/target − 1, −0.2, 0.2),
    β ← β·(1 + e·n/horizon)."""
    out = []
    for kl, n in steps:
        e = min(max(kl / target - 1, -0.2), 0.2)
        value = value * (1 + e * n / horizon)
        out.append(value)
    return out


# --------------------------------------------------------------------------- hand-computed
def test_adaptive_hand_computed_sequence():
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=1.0, horizon=100)
    steps = [
        (1.5, 50, 0.55),  # e = 0.5 clipped to 0.2: × 1.1
        (0.25, 50, 0.495),  # e = −0.75 clipped to −0.2: × 0.9
        (1.1, 100, 0.5445),  # e = 0.1: × 1.1
        (0.95, 200, 0.49005),  # e = −0.05: × 0.9
        (7.0, 0, 0.49005),  # no samples: unchanged
        (1.0, 1000, 0.49005),  # on target: unchanged
    ]
    for kl, n, expected in steps:
        ctrl.update(kl, n)
        assert ctrl.value == pytest.approx(expected, rel=1e-14, abs=0)
    assert isinstance(ctrl.value, float)


def test_adaptive_matches_the_definition_on_a_random_sequence():
    gen = torch.Generator().manual_seed(0)
    kls = (torch.rand(200, generator=gen, dtype=torch.float64) * 0.3).tolist()
    ns = torch.randint(0, 512, (200,), generator=gen).tolist()
    ctrl = AdaptiveKLController(0.2, 0.1, 10000)
    got = []
    for kl, n in zip(kls, ns, strict=True):
        ctrl.update(kl, n)
        got.append(ctrl.value)
    assert got == pytest.approx(ziegler(0.2, 0.1, 10000, zip(kls, ns, strict=True)), rel=1e-13)


@pytest.mark.parametrize("kl", [0.24, 1.0, 1e9, math.inf])
def test_kl_far_above_target_grows_by_at_most_the_clip(kl):
    ctrl = AdaptiveKLController(1.0, 0.2, 64)
    ctrl.update(kl, 16)
    assert ctrl.value == pytest.approx(1 + 0.2 * 16 / 64, rel=1e-15)  # 1.05


@pytest.mark.parametrize("kl", [0.16, 0.0, -3.0, -math.inf])
def test_kl_far_below_target_shrinks_by_at_most_the_clip(kl):
    ctrl = AdaptiveKLController(1.0, 0.2, 64)
    ctrl.update(kl, 16)
    assert ctrl.value == pytest.approx(1 - 0.2 * 16 / 64, rel=1e-15)  # 0.95


def test_inside_the_clip_the_change_is_proportional():
    for kl, factor in ((0.22, 1.025), (0.18, 0.975), (0.2, 1.0)):  # e = ±0.1 or 0, n/h = 1/4
        ctrl = AdaptiveKLController(2.0, 0.2, 64)
        ctrl.update(kl, 16)
        assert ctrl.value == pytest.approx(2.0 * factor, rel=1e-14)


def test_fixed_never_changes():
    ctrl = FixedKLController(0.05)
    for kl, n in ((3.0, 256), (0.0, 0), (float("nan"), 1), (torch.tensor(2.0), 8)):
        ctrl.update(kl, n)
        assert ctrl.value == 0.05 and isinstance(ctrl.value, float)


# --------------------------------------------------------------------------- number types
def test_numpy_numbers_and_cpu_tensors_give_the_float_result():
    np = pytest.importorskip("numpy")
    kinds = [
        lambda v: v,
        np.float64,
        np.float32,
        lambda v: torch.tensor(v, dtype=torch.float64),
        lambda v: torch.tensor(v, dtype=torch.float32),
        lambda v: torch.tensor(v, requires_grad=True),  # read without a grad warning
    ]
    kls = [0.3, 0.05, 0.12]  # each kind is compared with the Python float it holds
    for kind in kinds:
        ctrl = AdaptiveKLController(np.float32(0.25), torch.tensor(0.1), np.int64(1000))
        ref = AdaptiveKLController(0.25, float(torch.tensor(0.1)), 1000)
        for kl in kls:
            x = kind(kl)
            ctrl.update(x, np.int64(100))
            ref.update(float(x.detach()) if isinstance(x, torch.Tensor) else float(x), 100)
            assert isinstance(ctrl.value, float) and ctrl.value == ref.value
    ctrl = AdaptiveKLController(1.0, 2.0, 10)
    ctrl.update(torch.tensor(3, dtype=torch.int32), 5)  # integer KL (e = 0.5 → 0.2): × 1.1
    assert ctrl.value == pytest.approx(1.1, rel=1e-15)


def test_device_kl_is_not_read_meta():
    """A meta tensor has no values: the update can only succeed without reading it."""
    ctrl = AdaptiveKLController(0.2, 0.1, 10000)
    ctrl.update(torch.empty((), device="meta"), 64)
    assert isinstance(ctrl.value, torch.Tensor) and ctrl.value.device.type == "meta"
    assert ctrl.value.shape == () and ctrl.value.dtype == torch.float64
    ctrl.update(0.5, 64)  # a Python number keeps the tensor where it is
    assert ctrl.value.device.type == "meta"
    fixed = FixedKLController(0.2)
    fixed.update(torch.empty((), device="meta"), 64)
    assert fixed.value == 0.2


def test_device_kl_path_equals_the_float_path(monkeypatch):
    """The tensor path (taken on accelerators), run on CPU tensors: the same float64 numbers."""
    monkeypatch.setattr(klc, "_on_device", lambda t: True)
    kls = [0.3, 0.05, 0.12, 0.1, 0.0991]
    on_dev, ref = AdaptiveKLController(0.25, 0.1, 1000), AdaptiveKLController(0.25, 0.1, 1000)
    for kl in kls:
        x = torch.tensor(kl, dtype=torch.float32, requires_grad=True)
        on_dev.update(x, 300)
        ref.update(float(x.detach()), 300)
        assert isinstance(on_dev.value, torch.Tensor) and not on_dev.value.requires_grad
        assert on_dev.value.dtype == torch.float64 and float(on_dev.value) == ref.value
    on_dev.update(0.2, 10)  # a number after a tensor
    ref.update(0.2, 10)
    assert float(on_dev.value) == ref.value
    with pytest.raises(ValueError, match="current_kl"):
        on_dev.update(torch.tensor(float("nan")), 1)  # read on CPU: rejected


def test_kl_on_another_device_than_the_coefficient(monkeypatch):
    ctrl = AdaptiveKLController(0.2, 0.1, 10000)
    ctrl.update(torch.empty((), device="meta"), 64)
    monkeypatch.setattr(klc, "_on_device", lambda t: True)
    with pytest.raises(ValueError, match="current_kl"):
        ctrl.update(torch.tensor(0.1), 64)


# --------------------------------------------------------------------------- constants
def test_a_kl_with_a_graph_is_read_as_a_number_and_its_graph_left_alone():
    """The batch KL usually comes out of the loss computation: the update reads its value,
    builds nothing on it, and warns about nothing (no float() of a tensor requiring grad)."""
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    kl = (logp - torch.tensor([-1.2, -1.5, -0.5])).mean()  # 0.1/3, carries a graph
    ctrl, fixed = AdaptiveKLController(0.5, 0.1, 100), FixedKLController(0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctrl.update(kl, 10)
        fixed.update(kl, 10)
    e = max(float(kl.detach()) / 0.1 - 1, -0.2)  # -0.667 clipped to -0.2
    assert ctrl.value == pytest.approx(0.5 * (1 + e * 10 / 100), rel=1e-7)
    assert isinstance(ctrl.value, float) and fixed.value == 0.5
    kl.backward()  # the caller's graph is intact and unchanged
    assert torch.equal(logp.grad, torch.full((3,), 1 / 3))


def test_the_device_path_builds_no_graph(monkeypatch):
    """On an accelerator ``.value`` becomes a tensor: it never requires grad, whatever the KL."""
    monkeypatch.setattr(klc, "_on_device", lambda t: True)
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ctrl = AdaptiveKLController(0.5, 0.1, 100)
    with torch.enable_grad():
        for _ in range(3):
            ctrl.update((logp * 0.3).sum().neg(), 50)  # 0.9: above the target, × 1.1
    assert isinstance(ctrl.value, torch.Tensor)
    assert not ctrl.value.requires_grad and ctrl.value.grad_fn is None
    assert float(ctrl.value) == pytest.approx(0.5 * 1.1**3, rel=1e-12)


def test_n_steps_is_a_number_not_a_tensor():
    for ctrl in (FixedKLController(0.1), AdaptiveKLController(0.1, 0.1, 100)):
        with pytest.raises(TypeError, match="n_steps"):
            ctrl.update(0.2, torch.tensor(8.0, requires_grad=True))


# --------------------------------------------------------------------------- factory
@dataclasses.dataclass
class KLControlConfig:  # verl's dataclass (verl/trainer/config/algorithm.py), restated
    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


def test_the_submodule_is_reachable_from_the_package():
    assert rlops.kl_controllers.AdaptiveKLController is AdaptiveKLController
    assert rlops.kl_controllers.get_kl_controller is get_kl_controller
    assert rlops.losses.AdaptiveKLController is AdaptiveKLController
    assert rlops.losses.get_kl_controller is get_kl_controller


def test_factory_follows_verl():
    """verl: fixed -> FixedKLController(kl_coef=cfg.kl_coef); adaptive ->
    AdaptiveKLController(init_kl_coef=cfg.kl_coef, target_kl=cfg.target_kl, horizon=cfg.horizon)."""
    adaptive = {"type": "adaptive", "kl_coef": 0.2, "target_kl": 6.0, "horizon": 500}
    for cfg in (adaptive, SimpleNamespace(**adaptive), KLControlConfig(**adaptive)):
        ada = get_kl_controller(cfg)
        assert isinstance(ada, AdaptiveKLController)
        assert (ada.value, ada.target, ada.horizon) == (0.2, 6.0, 500)
    fixed = get_kl_controller(KLControlConfig(kl_coef=0.01, horizon=0))  # horizon unused
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.01
    default = get_kl_controller(KLControlConfig())  # verl's defaults: a fixed 0.001
    assert isinstance(default, FixedKLController) and default.value == 0.001
    assert get_kl_controller({}).value == 0.001  # missing keys: verl's defaults
    ada = get_kl_controller({"type": "adaptive"})
    assert (ada.value, ada.target, ada.horizon) == (0.001, 0.1, 10000)


def test_factory_errors_name_the_setting():
    for horizon in (0, -5):
        with pytest.raises(ValueError, match=r"kl_ctrl\.horizon"):
            get_kl_controller({"type": "adaptive", "horizon": horizon})
    for kind in ("Adaptive", "linear", None):
        with pytest.raises(ValueError, match=r"kl_ctrl\.type"):
            get_kl_controller({"type": kind})
    with pytest.raises(ValueError, match=r"kl_ctrl\.kl_coef"):
        get_kl_controller({"type": "fixed", "kl_coef": -1.0})
    with pytest.raises(ValueError, match=r"kl_ctrl\.target_kl"):
        get_kl_controller({"type": "adaptive", "target_kl": math.inf})
    for bad in (None, "adaptive", 0.1):
        with pytest.raises(TypeError, match="kl_ctrl"):
            get_kl_controller(bad)


def test_the_old_factory_is_a_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="get_kl_controller"):
        ada = kl_controller("adaptive", kl_coef=0.2, target_kl=6.0, horizon=500)
    assert isinstance(ada, AdaptiveKLController)
    assert (ada.value, ada.target, ada.horizon) == (0.2, 6.0, 500)
    with pytest.warns(DeprecationWarning):
        fixed = kl_controller("fixed", kl_coef=0.01, horizon=0)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.01
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="kind"):
        kl_controller("linear")


# --------------------------------------------------------------------------- bad input
def test_bad_input_errors_name_the_argument():
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kl_coef"):
            FixedKLController(bad)
        with pytest.raises(ValueError, match="init_kl_coef"):
            AdaptiveKLController(bad, 0.1, 100)
    with pytest.raises(TypeError, match="kl_coef"):
        FixedKLController("0.1")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="target_kl"):
            AdaptiveKLController(0.1, bad, 100)
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="horizon"):
            AdaptiveKLController(0.1, 0.1, bad)
    with pytest.raises(TypeError, match="horizon"):
        AdaptiveKLController(0.1, 0.1, None)
    for ctrl in (FixedKLController(0.1), AdaptiveKLController(0.1, 0.1, 100)):
        for bad in ("0.1", None, True, [0.1]):
            with pytest.raises(TypeError, match="current_kl"):
                ctrl.update(bad, 1)
        with pytest.raises(ValueError, match="current_kl"):
            ctrl.update(torch.ones(2), 1)
        for bad in (torch.tensor(True), torch.tensor(1j)):
            with pytest.raises(TypeError, match="current_kl"):
                ctrl.update(bad, 1)
        for bad in (1.5, "3", None, True, torch.tensor(3)):
            with pytest.raises(TypeError, match="n_steps"):
                ctrl.update(0.1, bad)
        with pytest.raises(ValueError, match="n_steps"):
            ctrl.update(0.1, -1)
    ada = AdaptiveKLController(0.1, 0.1, 100)
    for bad in (float("nan"), torch.tensor(float("nan"))):
        with pytest.raises(ValueError, match="current_kl"):
            ada.update(bad, 1)
    assert ada.value == 0.1  # a rejected update leaves the state as it was
