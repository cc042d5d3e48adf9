"""The benchmark scripts' command lines (their numbers are for reading, never asserted)."""

import json

import pytest

from benchmarks import e2e


def test_e2e_refuses_an_unknown_policy_by_name(capsys):
    with pytest.raises(SystemExit) as exc:
        e2e.main(["--policies", "full,streamingllm", "--no-torch", "--compile-layers", ""])
    assert exc.value.code == 2
    assert "--policies: unknown ['streamingllm']" in capsys.readouterr().err


def test_e2e_runs_only_the_chosen_policies_and_names_its_files_by_shape(tmp_path):
    e2e.main(["--shape", "issue25", "--lengths", "64", "--batches", "1", "--new", "4", "--budget", "32",
              "--policies", "streaming", "--no-torch", "--compile-layers", "", "--repeats", "1",
              "--out", str(tmp_path)])
    record = json.loads((tmp_path / "e2e_cpu_issue25.json").read_text())
    assert [(r["impl"], r["policy"], r["prompt"]) for r in record["rows"]] == [("kvjax", "streaming", 64)]
    assert record["meta"]["config"]["hidden_size"] == 256
    assert (tmp_path / "e2e_cpu_issue25.md").exists() and (tmp_path / "e2e_cpu_issue25.png").exists()
    assert not (tmp_path / "e2e_cpu.json").exists()
