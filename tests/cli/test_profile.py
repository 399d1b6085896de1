import contextlib
import json

import pytest
import torch

from rlops.cli import parser, profile
from rlops.cli.model import ModelConfig, TinyTransformer

TINY = "--batch 2 --seq-len 16 --vocab 32 --layers 1 --d-model 16 --heads 2 --repeats 1".split()
TINY += ["--device", "cpu"]


def parse(argv):
    return parser().parse_args(["profile", *argv])


def test_profile_tiny_config_writes_json_and_png(tmp_path, capsys):
    json_path, png_path = tmp_path / "profile.json", tmp_path / "profile.png"
    assert profile.run(parse([*TINY, "--json", str(json_path), "--plot", str(png_path)])) == 0
    data = json.loads(json_path.read_text())
    assert data["stages"] == list(profile.STAGES)
    for impl in ("naive", "rlops"):
        for stage in profile.STAGES:
            assert data["results"][impl][stage]["seconds"] > 0
        assert impl in data["step_peak_bytes"]
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png_path.stat().st_size > 1000
    out = capsys.readouterr().out
    assert "One PPO step:" in out
    assert "log-prob + entropy" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--batch", "0"],
        ["--seq-len", "x"],
        ["--dtype", "int8"],
        ["--layers", "-1"],
        ["--device", "tpu9"],
        ["--json", "/nonexistent-folder/p.json"],
        ["--top-p", "0"],
        ["--top-p", "1.01"],
        ["--rlops-head", "lm"],
    ],
)
def test_bad_options_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as err:
        parse(argv)
    assert err.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--d-model", "10", "--heads", "4"], "multiple of --heads"),
        (["--seq-len", "1"], "--seq-len"),
    ],
)
def test_unrunnable_options_exit_2(argv, message, capsys):
    assert profile.run(parse([*TINY, *argv])) == 2
    err = capsys.readouterr().err
    assert "rlops profile: error:" in err
    assert message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_device_exits_2(capsys):
    with pytest.raises(SystemExit) as err:
        parse([*TINY, "--device", "cuda"])
    assert err.value.code == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "forward_same"),
    [
        ([], False),
        (["--rlops-head", "logits", "--top-p", "0.9"], True),
        (["--top-p", "0.5"], False),
    ],
)
def test_rlops_head_and_top_p_options(argv, forward_same, tmp_path, capsys):
    """The fused-linear head (the default) runs the LM head inside the log-prob stage, so the
    forward is no longer the same code; the materialised head keeps it; top-p is replayed."""
    json_path = tmp_path / "p.json"
    assert profile.run(parse([*TINY, *argv, "--json", str(json_path)])) == 0
    config = json.loads(json_path.read_text())["config"]
    head = "logits" if "logits" in argv else "fused-linear"
    top_p = float(argv[argv.index("--top-p") + 1]) if "--top-p" in argv else None
    assert config["rlops_head"] == head and config["top_p"] == top_p
    out = capsys.readouterr().out
    assert f"rlops head: {head}" in out
    assert (f"top-p {top_p}" in out) == (top_p is not None)
    forward = next(line for line in out.splitlines() if "forward" in line)
    assert ("same code" in forward) == forward_same
    assert profile.same_code(head) == (("forward",) if forward_same else ()) + ("value head",)


@pytest.mark.parametrize("head", profile.HEADS)
@pytest.mark.parametrize("top_p", [None, 0.9])
def test_naive_and_rlops_steps_compute_the_same_loss_and_gradients(head, top_p):
    """The profile compares like with like: both steps give one loss and one gradient, with
    either rlops head, with and without a top-p support."""
    cfg = ModelConfig(vocab=40, context=24, d_model=16, n_layers=1, n_heads=2)
    torch.manual_seed(0)
    model = TinyTransformer(cfg).double()
    data = profile.make_batch(cfg, 3, 24, torch.device("cpu"), torch.Generator().manual_seed(1))
    data = {k: v.double() if v.is_floating_point() else v for k, v in data.items()}
    no_stages = lambda name: contextlib.nullcontext()  # noqa: E731
    losses, grads = {}, {}
    for impl in profile.IMPLS:
        losses[impl] = profile.ppo_step(model, data, impl, no_stages, head=head, top_p=top_p)
        grads[impl] = [p.grad.clone() for p in model.parameters()]
    torch.testing.assert_close(losses["naive"], losses["rlops"])
    for g_naive, g_rlops in zip(grads["naive"], grads["rlops"]):
        torch.testing.assert_close(g_naive, g_rlops)
