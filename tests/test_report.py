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
    for section in ("Perplexity", "Passkey retrieval (RazorAttention Table 1) at equal cache bytes", "LongBench-format",
                    "Zero-shot", "Passkey", "Efficiency"):
        assert section in text
    # MAT vs StreamingLLM and SlimKV vs SnapKV at each of the two budgets, Razor at equal bytes, zero-shot
    assert text.count("**holds**") + text.count("**does not hold**") == 6
    assert "at equal cache bytes" in text and text.count("**not run**") == 2  # AnLLM and the gate: no variants
    assert (out / "heads.json").is_file() and (out / "razor" / "results.png").is_file()
    # a random model does no task: its comparisons are said to be no evidence (zero-shot, Razor's passkey)
    assert text.count("no evidence either way") >= 2
    assert report.main(argv) == 0  # a rerun reuses every finished cell


def test_an_unknown_section_is_refused_and_so_is_the_old_name_of_razors_section(capsys):
    with pytest.raises(SystemExit):
        report.main(["--skip", "perplexity,neddle"])
    assert "--skip perplexity,neddle: neddle is not a section" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # section 2's name before it ran on the passkey task, removed at 0.1.0
        report.main(["--skip", "needle"])
    assert "--skip needle: needle is not a section" in capsys.readouterr().err


def test_a_comparison_is_evidence_only_where_the_full_cache_beats_its_floor_by_two_standard_errors():
    # chance 0.25 over 40 items: two standard errors are 2 sqrt(0.25 * 0.75 / 40) = 0.137
    assert "no evidence" in report._evidence(0.38, 0.25, "chance", 40)
    assert report._evidence(0.39, 0.25, "chance", 40) == ")"
    # a floor of 0 (no compressed cache retrieves anything): one item in n is the margin
    assert "no evidence" in report._evidence(0.0, 0.0, "StreamingLLM's or H2O's", 75)
    assert report._evidence(0.03, 0.0, "StreamingLLM's or H2O's", 75) == ")"


def test_ruler_batch_reaches_the_ruler_suite(tmp_path, monkeypatch):
    """`--ruler-batch` (prompts per call, which bounds memory) is handed to the RULER suite, where it is part of
    the section's identity."""
    from experiments.ruler import __main__ as ruler

    seen = {}

    class Stop(Exception):
        pass

    def suite(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(ruler, "suite", suite)
    model = make_random_checkpoint(tmp_path / "m", tiny_config(max_position_embeddings=512), seed=0)
    skip = ",".join(s for s in report.SECTIONS if s != "ruler")
    with pytest.raises(Stop):
        report.main(["--model", str(model), "--skip", skip, "--ruler-batch", "2", "--ruler-samples", "1",
                     "--out", str(tmp_path / "rep")])
    assert seen["batch"] == 2


def test_a_zero_shot_table_where_no_policy_evicted_is_no_evidence():
    # SmolLM2's one-fact passages (142-218 tokens) under the report's budget of 256: every share 1.0
    fits = {"full": {"kv_share": 1.0}, "streaming": {"kv_share": 1.0}, "mat": {"kv_share": 1.0}}
    assert not report._evicted(fits)
    assert report._evicted(fits | {"snapkv": {"kv_share": 0.498}})
    assert report._evicted(fits | {"mat": {"kv_share": None}})  # stream scoring measures no share


def test_slimkv_claim_says_a_tie_is_a_tie():
    """Equal averages (on SmolLM2's RULER both SlimKV and SnapKV find nothing, 0 vs 0) are a tie, not "holds";
    a higher SlimKV holds, a lower one does not; a full cache no better than both is no evidence."""
    tie = report._slimkv_claim("RULER-4096 at ratio 0.875", 0.0, 0.0, 63.33, 30)
    assert "**holds only as a tie** (average 0.0 vs 0.0, full 63.33; 30 items" in tie and "no evidence" not in tie
    assert "**holds** (average 40 vs 30" in report._slimkv_claim("x", 40, 30, 90, 30)
    assert "**does not hold** (average 30 vs 40" in report._slimkv_claim("x", 30, 40, 90, 30)
    assert "no evidence either way" in report._slimkv_claim("x", 30, 40, 45, 30)
