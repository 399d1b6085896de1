import json

import pytest
import torch

from rlops.cli import demo, parser
from rlops.cli.model import TinyTransformer


def parse(argv):
    return parser().parse_args(["demo", *argv])


def start_end(curve, n=5):
    return sum(curve[:n]) / n, sum(curve[-n:]) / n


@pytest.mark.slow
@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_demo_learns(multi_turn):
    """Reduced size (strings of 6 out of 8 symbols, 50 iterations; about 10 s on 2 cores):
    the mean reward rises from chance (1/11) by at least 0.5 and ends at >= 0.8 of the max."""
    cfg = demo.DemoConfig(length=6, symbols=8, iterations=50, multi_turn=multi_turn, seed=0)
    result = demo.train(cfg)
    curve = result["reward_curve"]
    assert len(curve) == 50
    start, end = start_end(curve)
    assert start < 0.2  # chance level, 1/11
    assert end >= start + 0.5
    assert end >= 0.8 * result["max_reward"]


def test_multi_turn_rollout_layout():
    """Tool output is the environment's (marker, second half, separator), with mask 0; the
    reward counts the policy's tokens only."""
    cfg = demo.DemoConfig(length=4, symbols=5, batch=16, multi_turn=True)
    _, sep, obs = demo.special_tokens(cfg)
    gen = torch.Generator().manual_seed(0)
    policy = TinyTransformer(demo.model_config(cfg))
    seq, p, mask, reward = demo.rollout(policy, cfg, gen)
    assert p == 4  # BOS, two symbols, SEP
    assert mask.shape == (16, 2 + 4 + 2)
    assert mask.tolist() == [[1, 1, 0, 0, 0, 0, 1, 1]] * 16
    tool = seq[:, p + 2 : p + 6]
    assert (tool[:, 0] == obs).all() and (tool[:, -1] == sep).all()
    assert ((tool[:, 1:3] >= 0) & (tool[:, 1:3] < cfg.symbols)).all()
    first, second = seq[:, 1:3], tool[:, 1:3]
    targets = torch.cat([first.flip(1), second.flip(1)], dim=1)
    actions = torch.cat([seq[:, p : p + 2], seq[:, p + 6 :]], dim=1)
    torch.testing.assert_close(reward, (actions == targets).float().mean(dim=1))


def test_demo_writes_json_and_png(tmp_path, capsys):
    json_path, png_path = tmp_path / "demo.json", tmp_path / "demo.png"
    argv = ["--iterations", "3", "--batch", "8", "--length", "4", "--seed", "1"]
    assert demo.run(parse([*argv, "--json", str(json_path), "--plot", str(png_path)])) == 0
    data = json.loads(json_path.read_text())
    assert len(data["reward_curve"]) == 3
    assert all(0.0 <= r <= 1.0 for r in data["reward_curve"])
    assert data["max_reward"] == 1.0
    assert data["seconds"] > 0
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png_path.stat().st_size > 1000
    assert "mean reward" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [["--iterations", "0"], ["--batch", "x"], ["--length", "-3"], ["--bogus"]]
)
def test_bad_options_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as err:
        parse(argv)
    assert err.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--multi-turn", "--length", "5"], "even --length"), (["--symbols", "1"], "--symbols")],
)
def test_unrunnable_options_exit_2(argv, message, capsys):
    assert demo.run(parse(argv)) == 2
    err = capsys.readouterr().err
    assert "rlops demo: error:" in err
    assert message in err
