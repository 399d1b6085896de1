"""Every script in examples/ runs at its small sizes (``--small``) and the README lists each;
the verl and slime stand-ins they (and the docs) fall back on follow the originals' formulas
on hand-computed numbers."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))


def _load_standins():
    spec = importlib.util.spec_from_file_location(
        "_rlops_standins", ROOT / "examples" / "_standins.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


standins = _load_standins()


def test_the_examples_are_there():
    assert [p.name for p in EXAMPLES] == [
        "grpo_step.py",
        "ppo_demo.py",
        "ppo_step.py",
        "slime_custom_functions.py",
        "verl_registry.py",
    ]


def test_the_readme_lists_every_example():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Examples\n", 1)[1].split("\n## ", 1)[0]
    linked = set(re.findall(r"\(examples/([\w.]+\.py)\)", section))
    assert linked == {p.name for p in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    # a generous guard against a hang, not a speed test: each takes seconds
    proc = subprocess.run(
        [sys.executable, str(path), "--small"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout}\n{proc.stderr}"
    assert len(proc.stdout.splitlines()) >= 2, proc.stdout


# --------------------------------------------------------------------------- the stand-ins
def test_the_standin_modules_form_packages():
    mods = standins.standin_modules("verl")
    core = mods["verl.trainer.ppo.core_algos"]
    assert mods["verl"].trainer.ppo.core_algos is core
    assert all(getattr(m, "__standin__", False) for m in mods.values())
    assert core.get_adv_estimator_fn("grpo") is core.compute_grpo_outcome_advantage
    with pytest.raises(ValueError, match="Unsupported loss mode"):
        core.get_policy_loss_fn("gspo")  # only what the docs and examples touch
    assert mods["verl.utils.torch_functional"].masked_whiten is standins.masked_whiten
    slime = standins.standin_modules("slime")
    assert slime["slime.utils.misc"].load_function("math.sqrt") is math.sqrt
    with pytest.raises(ValueError, match="stand-in"):
        standins.standin_modules("trl")


def test_verl_standin_gae_hand_computed():
    """γ = 0.9, λ = 0.5; token 1 is a tool's output (mask 0), skipped:
    t=2: δ = 1 − 0.25 = 0.75, A = 0.75; t=1 carries A = 0.75 and V_next = 0.25;
    t=0: δ = 0.9·0.25 − 0.5 = −0.275, A = −0.275 + 0.45·0.75 = 0.0625. returns = A + V.
    Whitened over the two action tokens (unbiased variance 2·0.34375²): ∓1/√2."""
    gae = standins.compute_gae_advantage_return
    adv, ret = gae(
        torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64),
        torch.tensor([[0.5, 9.0, 0.25]], dtype=torch.float64),
        torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64),
        0.9,
        0.5,
    )
    assert ret[0].tolist() == pytest.approx([0.5625, 9.75, 1.0], abs=1e-15)
    assert adv[0, [0, 2]].tolist() == pytest.approx([-(0.5**0.5), 0.5**0.5], abs=1e-7)


def test_verl_standin_grpo_hand_computed():
    """Group 0 scores (1, 0): mean 0.5, std 1/√2 -> ±1/√2; group 1 (1, 1): 0; a group of one
    keeps its score over (1 + ε)."""
    adv, ret = standins.compute_grpo_outcome_advantage(
        torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [7.0, 0.0]]),
        torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]]),
        ["a", "a", "b", "b", "c"],
    )
    r = 0.5**0.5
    expected = torch.tensor([[r, r], [-r, -r], [0, 0], [0, 0], [7 / (1 + 1e-6)] * 2])
    torch.testing.assert_close(adv, expected)
    assert ret is adv


def test_verl_standin_vanilla_loss_hand_computed():
    """ρ = e^0.5 ≈ 1.6487 with A = 1: max(−1.6487, −1.28) = −1.28 (clipped); ρ = e^2 with
    A = −1: max(7.389, 1.28) = 7.389 (not clipped), dual clip min(7.389, 3) = 3 (lower clip).
    token-mean over the 2 action tokens; verl's masked means divide by n + 1e-8."""
    old = torch.zeros(1, 3)
    logp = torch.tensor([[0.5, 2.0, 5.0]])
    loss, m = standins.compute_policy_loss_vanilla(
        old,
        logp,
        torch.tensor([[1.0, -1.0, 1.0]]),
        torch.tensor([[1.0, 1.0, 0.0]]),
        config={"clip_ratio": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0},
    )
    assert loss.item() == pytest.approx((-1.28 + 3.0) / 2, rel=1e-6)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5, rel=1e-7)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(0.5, rel=1e-7)
    assert m["actor/ppo_kl"] == pytest.approx(-1.25, rel=1e-7)


def test_slime_standin_tis_and_icepop_hand_computed():
    """ρ = e^1, e^0, e^−1 = 2.718, 1, 0.368: TIS in [0, 2] -> 2, 1, 0.368; IcePop in [0.5, 2]
    keeps only the middle one."""
    kwargs = {
        "pg_loss": torch.ones(3),
        "train_log_probs": [torch.tensor([1.0, 0.0]), torch.tensor([-1.0])],
        "rollout_log_probs": [torch.zeros(2), torch.zeros(1)],
        "loss_masks": None,
    }
    w, _, m = standins.vanilla_tis_function(Namespace(tis_clip=2.0, tis_clip_low=0.0), **kwargs)
    assert w.tolist() == pytest.approx([2.0, 1.0, math.exp(-1)], rel=1e-6)
    assert m["tis_clipfrac"].tolist() == [1.0, 0.0, 0.0]
    w, _, m = standins.icepop_function(Namespace(tis_clip=2.0, tis_clip_low=0.5), **kwargs)
    assert w.tolist() == [0.0, 1.0, 0.0] and m["tis_clipfrac"].tolist() == [1.0, 0.0, 1.0]
