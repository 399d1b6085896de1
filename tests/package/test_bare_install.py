"""The bare-install smoke test of ``.ci/run``, run here with numpy and numba hidden.

CI installs torch and rlops without extras into a fresh venv and runs a script that calls every
name of ``rlops.__all__`` from outside the repository. This test runs that same script (read
from ``.ci/run``) in a subprocess of the development environment in which ``import numpy`` and
``import numba`` fail, so a dependency on either shows up before CI.
"""

from __future__ import annotations

import os
import re
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


def _smoke_script() -> str:
    ci = (ROOT / ".ci" / "run").read_text()
    found = re.search(r"- <<'EOF'\n(.*?)\nEOF\n", ci, re.DOTALL)
    assert found, ".ci/run has no bare-install smoke script (a python - <<'EOF' block)"
    return found.group(1)


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
