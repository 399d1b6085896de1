"""``rlops check``: loads MODULE:FUNCTION, prints the report, exits 0, 1 on a failed check,
2 on a usage error."""

from __future__ import annotations

import textwrap

import pytest
import torch

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


def _exit_code(argv: list[str]) -> int:
    """``main``'s return value, or the code of the ``SystemExit`` argparse raises on a value its
    parser rejects (a type or a choice)."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is usable here")
_FUNCTIONS = {
    "logprobs": "rlops:logprobs_and_entropy",
    "loss": "rlops:policy_loss",
    "advantages": "rlops:gae",
}
#: (contract, options, what stderr must name)
_BAD_VALUES = [
    ("logprobs", ["--device", "nope"], "argument --device:"),
    ("logprobs", ["--vocab-sizes", "0"], "argument --vocab-sizes:"),
    ("logprobs", ["--vocab-sizes", ","], "argument --vocab-sizes:"),
    ("logprobs", ["--rows", "0"], "argument --rows:"),
    ("logprobs", ["--rows", "-3"], "argument --rows:"),
    ("logprobs", ["--temperature", "0"], "argument --temperature:"),
    ("logprobs", ["--temperature", "-1"], "argument --temperature:"),
    ("logprobs", ["--temperature", "nan"], "argument --temperature:"),
    ("logprobs", ["--dtypes", "bogus"], "argument --dtypes:"),
    ("logprobs", ["--seed", "1.5"], "argument --seed:"),
    ("loss", ["--kind", "bogus"], "argument --kind:"),
    ("loss", ["--param", "bogus=1"], "argument --param bogus:"),
    ("loss", ["--clip-low", "-0.5"], "argument --clip-low:"),
    ("loss", ["--agg", "bogus"], "argument --agg:"),
    ("advantages", ["--long-length", "0"], "argument --long-length:"),
    ("advantages", ["--long-length", "-1"], "argument --long-length:"),
    ("advantages", ["--lam", "nan"], "argument --lam:"),
    ("advantages", ["--gamma", "2"], "argument --gamma:"),
    ("advantages", ["--estimator", "bogus"], "argument --estimator:"),
]
_BAD_VALUE_CASES = [
    pytest.param(c, o, n, id=f"{c}{' '.join(['', *o])}") for c, o, n in _BAD_VALUES
] + [
    pytest.param(
        c, ["--device", "cuda"], "argument --device:", id=f"{c} --device cuda", marks=_NO_CUDA
    )
    for c in _FUNCTIONS
]


@pytest.mark.parametrize("contract, options, named", _BAD_VALUE_CASES)
def test_a_bad_option_value_exits_2_naming_the_option(capsys, contract, options, named):
    assert _exit_code(["check", contract, _FUNCTIONS[contract], *options]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert named in err, err


def test_a_module_with_a_syntax_error_is_a_usage_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_trainer_syntax.py").write_text("def loss(:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _exit_code(["check", "loss", "broken_trainer_syntax:loss"]) == 2
    err = capsys.readouterr().err
    assert "SyntaxError" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["advantages", "rlops:gae", "--long-length", "512"],
        [
            "logprobs",
            "rlops:logprobs_and_entropy",
            "--vocab-sizes",
            "100",
            "--rows",
            "4",
            "--dtypes",
            "float64",
        ],
    ],
    ids=["gae", "logprobs-float64"],
)
def test_rlops_own_ops_pass_as_they_are(capsys, argv):
    assert main(["check", *argv]) == 0
    assert "all checks passed" in capsys.readouterr().out


def _option_help(text: str) -> dict[str, str]:
    """Each option's entry of an argparse help text (its flags and help, wrapped lines
    joined, whitespace normalised), keyed by its long flag."""
    entries: list[str] = []
    section = False
    for line in text.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            section = line.rstrip(":") in ("options", "optional arguments")
        elif section and line.startswith("  -"):
            entries.append(line)
        elif section and entries and line.startswith("   "):
            entries[-1] += " " + line
    out = {}
    for entry in entries:
        words = entry.split()
        flag = next(w.rstrip(",") for w in words if w.startswith("--"))
        out[flag] = " ".join(words)
    return out


@pytest.mark.parametrize(
    "contract, options",
    [
        (
            "logprobs",
            ["--device", "--seed", "--temperature", "--vocab-sizes", "--dtypes", "--rows"],
        ),
        (
            "loss",
            [
                "--device",
                "--seed",
                "--agg",
                "--kind",
                "--clip-low",
                "--clip-high",
                "--loss-scale-factor",
            ],
        ),
        ("advantages", ["--device", "--seed", "--estimator", "--gamma", "--lam", "--long-length"]),
    ],
)
def test_help_shows_a_default_for_every_option(capsys, contract, options):
    with pytest.raises(SystemExit) as err:
        main(["check", contract, "--help"])
    assert err.value.code == 0
    helps = _option_help(capsys.readouterr().out)
    for option in options:
        assert option in helps, (option, sorted(helps))
        assert "(default" in helps[option], helps[option]
