import json

import pytest
import torch

from rlops.cli import main

TINY = ["--batch", "1", "--seq-len", "64", "--vocab", "256", "--logprob-tokens", "16",
        "--hidden", "8", "--group-batch", "8", "--repeats", "1", "--threads", "1"]  # fmt: skip


def test_bench_at_tiny_sizes(tmp_path, capsys):
    """The fast tier's bench, end to end in seconds: the sections timed in this process (the
    log-prob section measures each variant in a fresh process: the quick run below, and
    tests/cli/test_measure.py)."""
    path = tmp_path / "bench.json"
    assert main(["bench", *TINY, "--sections", "advantages", "group", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert {r["section"] for r in rows} == {"advantages", "group"}
    assert all(r["seconds"] > 0 for r in rows)
    assert "Verdict:" in capsys.readouterr().out


@pytest.mark.slow  # a minute on 2 cores
def test_bench_quick_writes_json_and_plot(tmp_path, capsys):
    path, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--quick", "--batch", "2", "--json", str(path), "--plot", str(png)]
    assert main(argv) == 0
    data = json.loads(path.read_text())
    rows = data["rows"]
    sections = {"advantages", "group", "logprobs", "agentic", "distillation"}
    assert {r["section"] for r in rows} == sections
    methods = {r["method"] for r in rows}
    assert {"per-token loop", "chunk loop (C=256)", "rlops auto", "memory floor"} <= methods
    assert {"unfused (log_softmax)", "rlops fused"} <= methods
    logprobs = {(r["case"], r["method"], r["ours"]) for r in rows if r["section"] == "logprobs"}
    assert logprobs == {
        ("log-prob + entropy", "unfused (log_softmax)", False),
        ("log-prob + entropy", "rlops fused", True),
        ("output layer + log-prob + entropy", "materialised logits + rlops fused", False),
        ("output layer + log-prob + entropy", "rlops fused linear", True),
        ("top-p 0.9 output layer", "materialised + keep mask", False),
        ("top-p 0.9 output layer", "rlops fused linear top-p", True),
        ("PPO loss phase from the output layer", "materialised + losses", False),
        ("PPO loss phase from the output layer", "rlops fused linear + losses", False),
        ("PPO loss phase from the output layer", "rlops linear_policy_loss", True),
    }
    distillation = {(r["case"], r["method"], r["ours"]) for r in rows
                    if r["section"] == "distillation"}  # fmt: skip
    kl = "top-k forward KL from the output layer"
    tail = "top-k forward KL + tail from the output layer"
    assert distillation == {
        (kl, "verl default (log_softmax, gather)", False),
        (kl, "verl chunked (use_chunked_topk)", False),
        (kl, "logits + rlops distillation_loss", False),
        (kl, "rlops linear_distillation_loss", True),
        (tail, "materialised + tail (log_softmax, gather)", False),
        (tail, "logits + rlops distillation_loss", False),
        (tail, "rlops linear_distillation_loss", True),
    }
    agentic = {(r["case"], r["method"], r["ours"]) for r in rows if r["section"] == "agentic"}
    assert agentic == {
        ("agentic: 3% valid rows", "rlops fused linear, every row", False),
        ("agentic: 3% valid rows", "rlops fused linear, mask=", True),
        ("agentic: 20 kept ids per row", "dense keep_mask", False),
        ("agentic: 20 kept ids per row", "CSR support_ids", True),
    }
    assert data["config"]["hidden"] == 64 and data["config"]["top_p"] == 0.9
    assert all(r["seconds"] > 0 for r in rows)
    counts = data["thread_counts"]
    assert counts == sorted({1, torch.get_num_threads()})
    for r in rows:  # every method at every count, each compared at its own faster count
        times = [r["times"][str(n)] for n in counts]
        assert r["seconds"] == min(times) and r["times"][str(r["threads"])] == r["seconds"]
    assert isinstance(data["warnings"], list)
    # the fused distillation op's chunks fit in freed heap at the quick size: measured, maybe 0
    lean = {(kl, "rlops linear_distillation_loss"), (tail, "rlops linear_distillation_loss")}
    fresh = [r for r in rows if r["section"] in ("logprobs", "distillation")]
    assert all(r["peak_bytes"] is not None and r["peak_bytes"] >= 0 for r in fresh)
    assert all(r["peak_bytes"] > 0 for r in fresh if (r["case"], r["method"]) not in lean)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "Verdict:" in out and "gae [2x2048]: per-token loop" in out
    assert "rlops bench 0/" in out and "advantages T=256" in out  # the progress line
    assert "- output layer + log-prob + entropy [256x4096, H=64], forward + backward:" in out
    assert "- top-p 0.9 output layer [256x4096, H=64], forward + backward:" in out
    assert "- agentic: 20 kept ids per row [256x4096, H=64], forward + backward:" in out
    assert f"- {kl} [256x4096, H=64, k=64], forward + backward: " in out
    assert f"- {tail} [256x4096, H=64, k=64], forward + backward: " in out


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--batch", "0"],
        ["bench", "--seq-len", "x"],
        ["bench", "--dtype", "int8"],
        ["bench", "--sections", "nothing"],
        ["bench", "--vocab", "-3"],
        ["bench", "--hidden", "0"],
        ["bench", "--top-p", "0"],
        ["bench", "--top-p", "nan"],
        ["nonsense"],
    ],
)
def test_bad_options_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert "error" in capsys.readouterr().err


def test_bad_discount_exits_2(capsys):
    assert main(["bench", "--quick", "--gamma", "1.5"]) == 2
    assert "gamma" in capsys.readouterr().err
