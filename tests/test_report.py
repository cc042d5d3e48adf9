"""The report: every suite run on one model and assembled (slow: a few minutes on CPU)."""

from __future__ import annotations

import pytest

from experiments import report
from models.tiny import make_random_checkpoint, tiny_config


@pytest.mark.slow
def test_report_runs_every_section_and_states_the_claims(tmp_path):
    model = make_random_checkpoint(tmp_path / "m", tiny_config(max_position_embeddings=512), seed=0)
    out = tmp_path / "report"
    argv = ["--model", str(model), "--budget", "64", "--budgets", "32,64", "--samples", "2", "--out", str(out)]
    assert report.main(argv) == 0
    text = (out / "report.md").read_text()
    for section in ("Perplexity", "Needle", "LongBench-format", "Zero-shot", "Passkey", "Efficiency"):
        assert section in text
    # MAT vs StreamingLLM and SlimKV vs SnapKV at each of the two budgets, Razor at equal bytes, zero-shot
    assert text.count("**holds**") + text.count("**does not hold**") == 6
    assert "at equal cache bytes" in text and text.count("**not run**") == 2  # AnLLM and the gate: no variants
    assert (out / "heads.json").is_file() and (out / "needle" / "heatmap_razor.png").is_file()
    assert report.main(argv) == 0  # a rerun reuses every finished cell
