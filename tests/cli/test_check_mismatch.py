"""``rlops check mismatch FILE.pt``: reads a saved dict, prints the diagnosis, exits 0 when a
hypothesis explains the engine's log-probs, 1 when none does, 2 on a usage error."""

from __future__ import annotations

import pytest
import torch

from rlops.cli import main


def _saved(tmp_path, **extra) -> str:
    """A file of an engine that applies temperature 0.5 to float32 logits (no noise)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 16, 50, generator=g) * 4
    target = torch.randint(0, 50, (3, 16), generator=g)
    lp = torch.log_softmax(logits.double() / 0.5, dim=-1).gather(-1, target[..., None])[..., 0]
    data = {"engine_logprobs": lp, "logits": logits, "target": target, "temperature": 0.5}
    path = tmp_path / "rollout.pt"
    torch.save({**data, **extra}, path)
    return str(path)


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def test_prints_the_table_and_the_verdict(tmp_path, capsys):
    assert main(["check", "mismatch", _saved(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "hypothesis" in out and "kl (k3)" in out
    assert "verdict: the engine's log-probs follow temperature, float32 logits" in out
    assert "temperature=0.5" in out


def test_an_option_overrides_the_file(tmp_path, capsys):
    # told the sampler ran at 0.9, nothing fits an engine that ran at 0.5
    assert main(["check", "mismatch", _saved(tmp_path), "--temperature", "0.9"]) == 1
    assert "verdict: no hypothesis explains" in capsys.readouterr().out


def test_a_mask_and_fewer_rows_shown(tmp_path, capsys):
    mask = torch.ones(3, 16, dtype=torch.bool)
    mask[:, -3:] = False
    assert main(["check", "mismatch", _saved(tmp_path, mask=mask), "--shown", "2"]) == 0
    out = capsys.readouterr().out
    assert "39 tokens" in out and "more" in out


@pytest.mark.parametrize(
    "extra, argv, named",
    [
        ({}, ["--temperature", "0"], "argument --temperature: temperature must be > 0"),
        ({"temperature": -1.0}, [], "rollout.pt: temperature must be > 0"),
        ({"bogus": 1}, [], "unknown keys ['bogus']"),
        ({"engine_logprobs": torch.zeros(2)}, [], "rollout.pt: engine_logprobs must have shape"),
        ({}, ["--top-p", "2"], "argument --top-p: top_p must lie in"),
        ({}, ["--rounding", "float64"], "argument --rounding:"),
        ({}, ["--shown", "0"], "argument --shown: must be >= 1"),
    ],
)
def test_bad_files_and_values_exit_2_naming_them(tmp_path, capsys, extra, argv, named):
    assert _exit_code(["check", "mismatch", _saved(tmp_path, **extra), *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err


def test_a_missing_or_foreign_file_exits_2(tmp_path, capsys):
    assert main(["check", "mismatch", str(tmp_path / "none.pt")]) == 2
    assert "cannot read" in capsys.readouterr().err
    path = tmp_path / "list.pt"
    torch.save([1, 2], path)
    assert main(["check", "mismatch", str(path)]) == 2
    assert "must hold a dict" in capsys.readouterr().err
    torch.save({"target": torch.zeros(3, dtype=torch.long)}, path)
    assert main(["check", "mismatch", str(path)]) == 2
    assert "has no engine_logprobs" in capsys.readouterr().err


def test_help_shows_a_default_for_every_option(capsys):
    with pytest.raises(SystemExit) as err:
        main(["check", "mismatch", "--help"])
    assert err.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for option in ("--temperature", "--top-k", "--top-p", "--min-p", "--rounding", "--shown"):
        assert option in out
    assert out.count("(default") == 8
