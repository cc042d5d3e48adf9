"""The efficiency suite: every cell timed, cache bytes as the policies imply, resumable, clear errors."""

from __future__ import annotations

import json

import pytest

from kvjax.experiments import efficiency


def test_cli_rows_cache_bytes_and_resume(tmp_path, tiny_dir):
    out = tmp_path / "out"
    argv = ["--model", str(tiny_dir), "--lengths", "64,128", "--new", "4", "--repeats", "1", "--compare",
            "full,streaming", "--budget", "32", "--out", str(out)]
    assert efficiency.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["label"], r["length"]) for r in rows] == [("full", 64), ("streaming", 64), ("full", 128),
                                                         ("streaming", 128)]
    assert all(r["decode_tok_s"] > 0 and r["prefill_s"] > 0 for r in rows)
    # 2 layers x 2 KV heads x head dim 16, k and v in float32, plus pos/score/log_w per slot
    full64, stream64, full128, stream128 = (r["cache_bytes"] for r in rows)
    assert stream64 == stream128 < full64 < full128  # the window does not grow with the context
    assert (out / "efficiency.png").is_file()
    assert (out / "cells.jsonl").read_text().count("\n") == 4
    assert efficiency.main(argv) == 0  # nothing is timed again
    assert (out / "cells.jsonl").read_text().count("\n") == 4


def test_too_long_is_a_clear_error(tmp_path, tiny_dir, capsys):
    with pytest.raises(SystemExit):
        efficiency.main(["--model", str(tiny_dir), "--lengths", "4095", "--new", "8", "--out", str(tmp_path)])
    assert "--lengths [4095] + --new 8 exceed max_position_embeddings=4096" in capsys.readouterr().err
