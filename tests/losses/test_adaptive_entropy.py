"""``AdaptiveEntropyController`` against TRL's own adaptive entropy control (copied below): the
coefficient and its gating over random sequences of entropies around the target, TRL's names
and defaults, the device path (never read), bad input."""

from __future__ import annotations

import dataclasses
import inspect
import math
import random

import pytest
import torch
from tests._bad_input import names

import rlops
import rlops.losses.kl_controllers as klc
from rlops.kl_controllers import AdaptiveEntropyController


# --------------------------------------------------------------------------- the peer's code
# huggingface/trl 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer: __init__'s state and the two
# blocks of _compute_loss that use use_adaptive_entropy, verbatim. Adapted: the config is an
# object holding GRPOConfig's fields; the window's entropy is passed in (TRL's
# `world_entropy`, reduced over the accumulation window and the processes, read by .item()).
class TRLAdaptiveEntropy:
    def __init__(self, args):
        self.args = args
        self.entropy_coef = args.entropy_coef
        self._last_world_entropy = float("inf")

    def apply_coef(self):
        apply_coef = (
            self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        )
        return apply_coef

    def step(self, world_entropy):
        if world_entropy <= self.args.entropy_target:
            self.entropy_coef = min(
                self.entropy_coef + self.args.entropy_coef_delta, self.args.entropy_coef_max
            )
        else:
            self.entropy_coef = max(
                self.entropy_coef - self.args.entropy_coef_delta, self.args.entropy_coef_min
            )
        self._last_world_entropy = world_entropy


@dataclasses.dataclass
class Args:  # GRPOConfig's fields of the controller, with GRPOConfig's defaults
    entropy_coef: float = 0.0
    entropy_target: float = 0.2
    entropy_coef_delta: float = 0.005
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0


FIELDS = [f.name for f in dataclasses.fields(Args)]


def test_names_and_defaults_are_grpo_configs():
    """The controller's arguments are GRPOConfig's fields, with its defaults."""
    params = inspect.signature(AdaptiveEntropyController).parameters
    assert list(params) == FIELDS
    assert {k: p.default for k, p in params.items()} == dataclasses.asdict(Args())
    trl = pytest.importorskip("trl")
    config = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    assert {k: config[k] for k in FIELDS} == dataclasses.asdict(Args())


SETTINGS = {
    "defaults": Args(),
    "started": Args(entropy_coef=0.01, entropy_target=1.0),
    "bounds": Args(
        entropy_coef=0.3,
        entropy_target=2.0,
        entropy_coef_delta=0.07,
        entropy_coef_min=0.1,
        entropy_coef_max=0.4,
    ),
    "start outside the bounds": Args(entropy_coef=0.9, entropy_coef_max=0.5, entropy_target=0.5),
    "negative coefficient": Args(entropy_coef=-0.02, entropy_coef_min=-1.0, entropy_target=1.0),
    "no step": Args(entropy_coef=0.05, entropy_coef_delta=0.0),
    "infinite bound": Args(entropy_coef=0.05, entropy_coef_max=math.inf, entropy_target=1.0),
}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", list(SETTINGS))
def test_matches_trl(name, seed):
    """Random entropies around the target (exactly on it too): ``.value`` before each step
    equals TRL's applied coefficient, ``.entropy_coef`` and ``.entropy`` after it TRL's state,
    bit for bit."""
    args = SETTINGS[name]
    rng = random.Random(seed)
    peer, ctrl = TRLAdaptiveEntropy(args), AdaptiveEntropyController(**dataclasses.asdict(args))
    for _ in range(200):
        assert ctrl.value == peer.apply_coef()
        h = rng.choice([args.entropy_target, rng.uniform(0, 2 * args.entropy_target + 1)])
        peer.step(h)
        ctrl.update(h)
        assert ctrl.entropy_coef == peer.entropy_coef
        assert ctrl.entropy == peer._last_world_entropy
    assert ctrl.value == peer.apply_coef()


def test_by_hand():
    ctrl = AdaptiveEntropyController(entropy_coef=0.0, entropy_target=0.2)
    assert ctrl.value == 0.0 and ctrl.entropy == math.inf
    ctrl.update(0.1)  # below: 0 + 0.005, applied
    assert ctrl.entropy_coef == 0.005 and ctrl.value == 0.005
    ctrl.update(0.2)  # on the target counts as below
    assert ctrl.entropy_coef == 0.01 and ctrl.value == 0.01
    ctrl.update(3.0)  # above: lowered and not applied
    assert ctrl.entropy_coef == 0.005 and ctrl.value == 0.0
    ctrl.update(3.0)
    ctrl.update(3.0)  # held at entropy_coef_min
    assert ctrl.entropy_coef == 0.0
    assert repr(ctrl).startswith("AdaptiveEntropyController(entropy_coef=0.0, entropy_target=0.2")


def test_exported_on_the_kept_path():
    assert rlops.kl_controllers.AdaptiveEntropyController is AdaptiveEntropyController
    assert "AdaptiveEntropyController" in rlops.kl_controllers.__all__


# --------------------------------------------------------------------------- tensors
def test_device_entropy_is_not_read_meta():
    """A meta tensor has no values: the update can only succeed without reading it."""
    ctrl = AdaptiveEntropyController(entropy_coef=0.01)
    ctrl.update(torch.empty((), device="meta"))
    assert isinstance(ctrl.entropy_coef, torch.Tensor) and ctrl.entropy_coef.device.type == "meta"
    value = ctrl.value
    assert isinstance(value, torch.Tensor) and value.device.type == "meta" and value.shape == ()
    ctrl.update(0.5)  # a number after a tensor stays on the tensor's device
    assert ctrl.entropy_coef.device.type == "meta"


def test_device_path_equals_the_float_path(monkeypatch):
    """The tensor path (taken on accelerators), run on CPU tensors: the same numbers as TRL's."""
    monkeypatch.setattr(klc, "_on_device", lambda t: True)
    args = Args(entropy_coef=0.02, entropy_target=1.0, entropy_coef_delta=0.01)
    peer, ctrl = TRLAdaptiveEntropy(args), AdaptiveEntropyController(**dataclasses.asdict(args))
    for h in [0.5, 1.0, 1.5, 2.0, 0.1, 0.1, 3.0, 3.0, 3.0]:
        x = torch.tensor(h, dtype=torch.float64, requires_grad=True)
        peer.step(h)
        ctrl.update(x)
        assert isinstance(ctrl.value, torch.Tensor) and not ctrl.value.requires_grad
        assert ctrl.entropy_coef.dtype == torch.float64
        assert float(ctrl.entropy_coef) == pytest.approx(peer.entropy_coef, abs=1e-15)
        assert float(ctrl.value) == pytest.approx(peer.apply_coef(), abs=1e-15)
    with pytest.raises(ValueError, match=names("entropy")):
        ctrl.update(torch.tensor(float("nan")))  # read on CPU: rejected


def test_entropy_on_another_device_than_the_coefficient(monkeypatch):
    ctrl = AdaptiveEntropyController()
    ctrl.update(torch.empty((), device="meta"))
    monkeypatch.setattr(klc, "_on_device", lambda t: True)
    with pytest.raises(ValueError, match=names("entropy")):
        ctrl.update(torch.tensor(0.1))


def test_an_entropy_with_a_graph_is_read_and_its_graph_left_alone():
    logits = torch.randn(4, 5, requires_grad=True)
    p = logits.softmax(-1)
    h = -(p * p.log()).sum(-1).mean()
    ctrl = AdaptiveEntropyController(entropy_target=10.0)
    ctrl.update(h)
    assert isinstance(ctrl.entropy_coef, float) and ctrl.entropy == float(h.detach())
    h.backward()
    assert logits.grad is not None


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "error", "arg"),
    [
        ({"entropy_coef": math.nan}, ValueError, "entropy_coef"),
        ({"entropy_coef": math.inf}, ValueError, "entropy_coef"),
        ({"entropy_coef": "0.1"}, TypeError, "entropy_coef"),
        ({"entropy_target": math.nan}, ValueError, "entropy_target"),
        ({"entropy_target": None}, TypeError, "entropy_target"),
        ({"entropy_coef_delta": -0.005}, ValueError, "entropy_coef_delta"),
        ({"entropy_coef_delta": math.inf}, ValueError, "entropy_coef_delta"),
        ({"entropy_coef_min": math.nan}, ValueError, "entropy_coef_min"),
        ({"entropy_coef_max": math.nan}, ValueError, "entropy_coef_max"),
        ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, ValueError, "entropy_coef_min"),
        ({"entropy_coef_max": torch.ones(2)}, TypeError, "entropy_coef_max"),
    ],
)
def test_bad_settings(kwargs, error, arg):
    with pytest.raises(error, match=names(arg)):
        AdaptiveEntropyController(**kwargs)


@pytest.mark.parametrize(
    ("entropy", "error"),
    [
        (math.nan, ValueError),
        (torch.tensor(math.nan), ValueError),
        ("0.3", TypeError),
        (None, TypeError),
        (torch.ones(2), ValueError),
        (torch.tensor(True), TypeError),
    ],
)
def test_bad_entropy(entropy, error):
    ctrl = AdaptiveEntropyController(entropy_coef=0.01)
    with pytest.raises(error, match=names("entropy")):
        ctrl.update(entropy)
    assert ctrl.entropy_coef == 0.01 and ctrl.entropy == math.inf  # left as it was
