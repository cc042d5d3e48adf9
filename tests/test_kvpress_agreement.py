"""kvjax.experiments.kvpress_agreement (issue 65, item 7): kvpress 0.5.5's own pipeline beside kvjax's committed RULER
records. The table on a hand-made case, the refusals, and (slow, the real model) kvpress giving kvjax's committed
answers for two methods."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvjax.experiments import kvpress_agreement as agreement
from kvjax import cli

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "report-smollm2" / "runs" / "ruler-chat"


def row(method, ratio, index, kvjax, kvpress, score=(1.0, 1.0)):
    return {"method": method, "ratio": ratio, "task": "niah_single_1", "index": index, "kvjax": kvjax,
            "kvpress": kvpress, "same": kvjax == kvpress, "kvjax_score": score[0], "kvpress_score": score[1]}


def test_the_table_counts_same_answers_and_lists_each_difference():
    rows = [row("full", None, 0, "123.", "123."), row("full", None, 1, "456.", "456."),
            row("knorm", 0.5, 0, "123.", "123."), row("knorm", 0.5, 1, "45.", "456.", score=(0.0, 1.0))]
    text, summary = agreement.table(rows, ["full", "knorm"], [0.5, 0.875])
    lines = text.splitlines()
    assert lines[2] == "| full |  | 2 | 2 | 2 | 2 | no press |"
    assert lines[3] == "| knorm | 0.5 | 2 | 1 | 1 | 2 | KnormPress |"
    assert "0.875" not in text  # a ratio with no records is not a row of zeros
    assert "| knorm | 0.5 | niah_single_1 | 1 | '45.' | '456.' |" in text
    assert summary["knorm@0.5"] == {"samples": 2, "same": 1, "kvjax_found": 1.0, "kvpress_found": 2.0}


def test_timed_answers_give_the_pipeline_seconds_median_and_range():
    """Answers with the pipeline call's seconds: a column of their median (min–max) per method and ratio; a row
    whose answers were logged untimed (an older run resumed) leaves its cell empty."""
    rows = [row("full", None, 0, "1.", "1.") | {"kvpress_seconds": 4.0},
            row("full", None, 1, "2.", "2.") | {"kvpress_seconds": 9.0},
            row("full", None, 2, "3.", "3.") | {"kvpress_seconds": 5.0},
            row("knorm", 0.5, 0, "1.", "1.")]
    text, summary = agreement.table(rows, ["full", "knorm"], [0.5])
    lines = text.splitlines()
    assert lines[0].endswith("| kvpress s an answer | kvpress as |")
    assert lines[2] == "| full |  | 3 | 3 | 3 | 3 | 5.00 (4.00–9.00) | no press |"
    assert lines[3] == "| knorm | 0.5 | 1 | 1 | 1 | 1 |  | KnormPress |"
    assert summary["full"]["kvpress_seconds"] == (5.0, 4.0, 9.0) and summary["knorm@0.5"]["kvpress_seconds"] is None


def test_a_method_without_a_press_or_a_missing_run_is_one_line(tmp_path, capsys):
    argv = ["--records", str(RECORDS), "--model", "smollm2", "--out", str(tmp_path / "o")]
    assert cli.run(agreement.main, argv + ["--methods", "full,h2o"], compile_cache=None) == 2
    assert "'h2o' has no kvpress press here" in capsys.readouterr().err
    argv[1] = str(tmp_path / "nowhere")
    assert cli.run(agreement.main, argv, compile_cache=None) == 2
    assert "not a kvjax RULER run (no identity.json)" in capsys.readouterr().err


@pytest.mark.slow
def test_kvpress_pipeline_gives_kvjax_committed_answers_for_streaming_and_knorm(tmp_path):
    """The real model, niah_single_1's first prompt at 4K in the chat template: kvpress's pipeline (transformers'
    GGUF loading, StreamingLLMPress and KnormPress at 0.5) answers what kvjax's committed records say."""
    pytest.importorskip("kvpress")
    from kvjax.models.fetch import cached_path

    if not cached_path("smollm2").is_file():
        pytest.skip("the SmolLM2 file is absent: python -m kvjax.models.fetch smollm2")
    out = tmp_path / "agree"
    assert agreement.main(["--records", str(RECORDS), "--model", "smollm2", "--methods", "streaming,knorm",
                           "--ratios", "0.5", "--samples", "1", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["same"] for r in rows), rows
    # the knorm answer is kvjax's committed one (not an empty string both sides agree on)
    assert all(r["kvpress"] for r in rows)
