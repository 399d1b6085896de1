"""``import rlops.compat.trl`` and its functions work without TRL installed."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
for name in ("trl", "transformers", "accelerate", "datasets"):
    sys.modules[name] = None  # an import of any of them now raises ImportError
import torch
from rlops.compat import trl
logp = torch.zeros(2, 3, requires_grad=True)
loss, metrics = trl.grpo_loss(logp, None, torch.tensor([1.0, -1.0]), torch.ones(2, 3))
loss.backward()
assert trl.grpo_advantages(torch.tensor([1.0, 0.0]), 2).shape == (2,)
assert "clip_ratio/region_mean" in metrics
print("ok")
"""


def test_import_and_functions_without_trl():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_trl_example_without_trl_fails_with_the_install_line():
    """``examples/trl/grpo.py --small --check`` without TRL must not pass silently (a CI that
    ran it would): it exits non-zero and says how to install the extra from the checkout."""
    from pathlib import Path

    script = Path(__file__).parents[2] / "examples" / "trl" / "grpo.py"
    code = (
        "import runpy, sys\n"
        "sys.modules['trl'] = None\n"
        f"sys.argv = [{str(script)!r}, '--small', '--check']\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, out.stdout
    assert "pip install torch==2.13.0 -e '.[trl]'" in out.stderr
    assert "skipped" not in out.stdout
