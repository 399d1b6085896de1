"""TRL's own generation against its trainer's log-probs, diagnosed: ``examples/trl/consistency.py``.

TRL samples with ``model.generate`` under its ``GRPOConfig`` (temperature 0.7, top-k 5 here):
transformers documents its ``scores`` as the processed logits the token was sampled from, so the
generation's log-prob is ``log_softmax(scores)`` at the sampled id. The diagnosis must name
"temperature, top-k renormalised, float32 logits" (the generation is the same float32 model),
with the runner-up at least 10x further; TRL's trainer (its fused head takes the temperature
only) is the not-renormalised row, far off.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("transformers")
pytest.importorskip("datasets")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "trl"


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module("consistency")
    finally:
        sys.path.remove(str(EXAMPLES))


def test_trls_generation_is_explained_by_temperature_and_renormalised_top_k(example):
    from rlops.testing import diagnose_mismatch

    trainer = example.make_trainer(1, temperature=example.TEMPERATURE, top_k=example.TOP_K)
    try:
        engine, logits, target, mask = example.generation_and_trainer_logprobs(trainer, 8)
    finally:
        shutil.rmtree(trainer.args.output_dir, ignore_errors=True)
    assert mask.sum() > 100  # enough sampled tokens to rank the hypotheses
    report = diagnose_mismatch(engine, logits, target, mask, temperature=0.7, top_k=5)
    best, runner_up = report.rows[0], report.rows[1]
    assert best.name == "temperature, top-k renormalised, float32 logits"
    assert best.options == {"temperature": 0.7, "top_k": 5}
    assert best.max_abs_diff < 1e-5  # the same float32 model, KV cache against one forward
    assert runner_up.mean_abs_diff >= 10 * best.mean_abs_diff
    assert report.explained
    trl = report["temperature, top-k not renormalised, float32 logits"]
    assert trl.mean_abs_diff > 0.1  # TRL's trainer: temperature only, the full softmax
