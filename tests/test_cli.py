import json

import pytest

from rlops.cli import main


def test_bench_quick_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--batch", "2", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    methods = {r["method"] for r in data["rows"]}
    assert {"per-token loop", "chunk loop (C=256)", "rlops auto", "memory floor"} <= methods
    assert all(r["seconds"] > 0 for r in data["rows"])
    assert "faster than the per-token loop" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--batch", "0"],
        ["bench", "--seq-len", "x"],
        ["bench", "--dtype", "int8"],
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
