"""``rlops check``: loads MODULE:FUNCTION, prints the report, exits 0, 1 on a failed check,
2 on a usage error."""

from __future__ import annotations

import textwrap

import pytest

from rlops.cli import main

TRAINER = textwrap.dedent("""
    import torch
    import rlops

    def logp(logits, target, temperature):
        return rlops.logprobs_and_entropy(logits, target, temperature=temperature)

    def logp_twice(logits, target, temperature):
        return logp(logits / temperature, target, temperature)

    def ppo(logp, old_logp, advantages, mask, num_tokens=None):
        return rlops.policy_loss(logp, old_logp, advantages, mask, clip_low=0.2,
                                 num_tokens=num_tokens)

    def ppo_micro_mean(logp, old_logp, advantages, mask, num_tokens=None):
        return rlops.policy_loss(logp, old_logp, advantages, mask, clip_low=0.2)

    class Estimators:
        @staticmethod
        def gae(rewards, values, mask, gamma, lam):
            return rlops.gae(rewards, values, gamma=gamma, lam=lam, mask=mask)
""")


@pytest.fixture
def trainer(tmp_path, monkeypatch, request):
    name = f"my_trainer_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(TRAINER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize(
    "argv, code, failed",
    [
        (["loss", ":ppo", "--clip-low", "0.2"], 0, None),
        (["loss", ":ppo_micro_mean", "--clip-low", "0.2"], 1, "micro_batch_invariance"),
        (["logprobs", ":logp", "--vocab-sizes", "100", "--rows", "4", "--bitwise"], 0, None),
        (
            [
                "logprobs",
                ":logp_twice",
                "--vocab-sizes",
                "100",
                "--rows",
                "4",
                "--temperature",
                "0.7",
            ],
            1,
            "temperature",
        ),
        (["advantages", ":Estimators.gae", "--long-length", "512"], 0, None),
    ],
)
def test_check_prints_the_report_and_exits_by_the_result(trainer, capsys, argv, code, failed):
    contract, fn, *options = argv
    assert main(["check", contract, trainer + fn, *options]) == code
    out = capsys.readouterr().out
    assert "check" in out and "result" in out and "measured" in out
    if failed:
        assert f"{failed}  " in out and "FAIL" in out and f"  {failed}: " in out
    else:
        assert "all checks passed" in out


def test_check_kind_options(trainer, capsys):
    argv = ["check", "loss", f"{trainer}:ppo", "--clip-low", "0.2", "--param", "dual_clip=3"]
    assert main(argv) == 1  # the function has no dual clip: its values differ
    assert "values" in capsys.readouterr().out


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon", "MODULE:FUNCTION"),
        ("no_such_module_here:f", "no_such_module_here"),
        (":ppo", "MODULE:FUNCTION"),
    ],
)
def test_bad_function_names_are_usage_errors(trainer, capsys, spec, message):
    assert main(["check", "loss", spec]) == 2
    assert message in capsys.readouterr().err


def test_missing_attribute_is_a_usage_error(trainer, capsys):
    assert main(["check", "loss", f"{trainer}:nope"]) == 2
    assert "no attribute 'nope'" in capsys.readouterr().err
