"""KL controllers: hand-computed update sequences (Ziegler et al.'s rule), the ±0.2 clip,
numbers and tensors as ``current_kl`` (a device tensor is never read), verl's factory, bad input."""

from __future__ import annotations

import math

import pytest
import torch

import rlops.kl_controllers as klc
from rlops.kl_controllers import AdaptiveKLController, FixedKLController, kl_controller


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


# --------------------------------------------------------------------------- factory
def test_factory_follows_verl():
    fixed = kl_controller("fixed", kl_coef=0.01, horizon=0)  # horizon ignored, as in verl
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.01
    ada = kl_controller("adaptive", kl_coef=0.2, target_kl=6.0, horizon=500)
    assert isinstance(ada, AdaptiveKLController)
    assert (ada.value, ada.target, ada.horizon) == (0.2, 6.0, 500)
    default = kl_controller("adaptive")  # verl's KLControlConfig defaults
    assert (default.value, default.target, default.horizon) == (0.001, 0.1, 10000)
    assert kl_controller("fixed").value == 0.001
    for horizon in (0, -5):
        with pytest.raises(ValueError, match="horizon"):
            kl_controller("adaptive", horizon=horizon)
    for kind in ("Adaptive", "linear", None):
        with pytest.raises(ValueError, match="kind"):
            kl_controller(kind)


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
