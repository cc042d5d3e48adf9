"""`python -m kvjax.experiments.decoding` on the embedded default model: the full cache is the reference (KL 0,
its own greedy output agreeing all the way), policies at one ratio hold the same bytes, a rerun resumes with nothing
recomputed, and errors are one line."""

from __future__ import annotations

import json

from kvjax.experiments import decoding
from tests.test_reliability import one_error_line, run_cli

ARGS = ["--new-tokens", "64", "--prompts", "2", "--prompt-len", "64", "--ratios", "4", "--decode-slots", "16"]


def test_decoding_suite_records_resume_and_tables(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ARGS + ["--compare", "full,streaming,knorm,rkv", "--out", str(out)]
    assert decoding.main(argv) == 0
    records = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 + 3 * 2
    full = [r for r in records if r["label"] == "full"]
    assert all(r["kl"] == 0 and r["agree"] == 64 and r["nll"] == r["nll_full"] for r in full)
    held = {r["label"]: r["kv_bytes"] / full[r["prompt"]]["kv_bytes"] for r in records}
    assert {held[f"{n} 4:1"] for n in ("streaming", "knorm", "rkv")} == {32 / 128}  # (64 + 64) // 4 of 128 slots
    assert all(r["kl"] > 0 for r in records if r["label"] != "full")
    assert all(len(r["kl_bins"]) == 1 for r in records)
    table = (out / "results.md").read_text()
    assert "| knorm 4:1 | 2 |" in table and "cores" in table and (out / "results.png").exists()
    capsys.readouterr()
    assert decoding.main(argv) == 0  # resumes: every record reused, none recomputed
    assert "8 records of this identity reused, 0 to compute" in capsys.readouterr().err
    assert (out / "records.jsonl").read_text().count("\n") == 8


def _refused(argv, capsys) -> str:
    """The one error line of a command line refused with exit status 2 (by argparse, or by `cli.run`)."""
    try:
        code, err = run_cli(decoding.main, argv, capsys)
    except SystemExit as e:
        code, err = e.code, capsys.readouterr().err
    assert code == 2, err
    return one_error_line(err)


def test_decoding_suite_errors_are_one_line(tmp_path, capsys):
    assert "--compare snapkv at --ratios 4" in _refused(ARGS + ["--compare", "full,snapkv", "--out", str(tmp_path / "a")],
                                                         capsys)
    assert "--compare chunkkv" in _refused(ARGS + ["--compare", "full,chunkkv", "--out", str(tmp_path / "b")], capsys)
    assert "--decode-slots" in _refused(ARGS[:-2] + ["--decode-slots", "0", "--out", str(tmp_path / "c")], capsys)
    assert "--ratios 16 leaves 8 slots" in _refused(ARGS[:6] + ["--ratios", "16", "--decode-slots", "16", "--out",
                                                                str(tmp_path / "d")], capsys)
