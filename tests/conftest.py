"""Test-suite settings.

Property tests explore new random examples on every local run; under CI (``CI`` set, as
``.ci/run`` is run) they replay a fixed sequence, so a submission's result does not depend on
which examples one run happened to draw. Counterexamples found locally become fixes and, where
useful, explicit ``@example`` cases.
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
