"""Doctest collection of the package: modules whose optional dependency is not installed are
skipped (their kernels are defined at import), as the tests that use them skip."""

import importlib.util

collect_ignore_glob = []
if importlib.util.find_spec("triton") is None:
    collect_ignore_glob.append("rlops/*/triton.py")
