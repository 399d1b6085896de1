"""The bare-install smoke test of ``.ci/run``, run here with numpy and numba hidden.

CI installs torch and rlops without extras into a fresh venv and runs
``tests/package/bare_install_smoke.py``, which calls every name of ``rlops.__all__`` from
outside the repository. This test runs that same script in a subprocess of the development
environment in which ``import numpy`` and ``import numba`` fail, so a dependency on either shows
up before CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_HIDE = '''
import sys

class _Hidden:
    """Make numpy and numba unimportable, as in an install without them."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("numpy", "numba"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Hidden())
'''


SMOKE = ROOT / "tests" / "package" / "bare_install_smoke.py"


def test_ci_runs_the_smoke_script():
    assert "tests/package/bare_install_smoke.py" in (ROOT / ".ci" / "run").read_text()


def _smoke_script() -> str:
    return SMOKE.read_text()


def test_ci_smoke_script_runs_without_numpy_and_numba(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("RLOPS_CHECK_VALUES", None)
    proc = subprocess.run(
        [sys.executable, "-"],
        input=_HIDE + _smoke_script(),
        cwd=tmp_path,  # outside the repository
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "public functions ran" in proc.stdout, proc.stdout
