"""The report page's generated blocks (experiments.report_page) against the committed records, and the paired
comparisons they print (experiments.ruler.compare) on hand-computed cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments import report_page, verdicts
from experiments.ruler import compare

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "report-smollm2.md"

SNAP = "SnapKV(budget=None, ratio=0.5, observation_window=32, kernel=7, pool='{}', group_agg='mean')"
SLIM = "SlimKV(budget=None, ratio=0.5, observation_window=32, kernel=7, pool='{}', combine='product')"


def records(label: str, policy: str, found: list[int], task: str = "niah_single_1") -> list[dict]:
    return [{"label": label, "policy": policy, "task": task, "length": 4096, "index": i, "score": float(s)}
            for i, s in enumerate(found)]


def test_the_committed_report_page_is_what_its_records_give():
    """Every generated block of docs/report-smollm2.md equals its regeneration from the committed records."""
    assert "<!-- records: ruler" in PAGE.read_text()
    assert report_page.regenerate(PAGE) == PAGE.read_text(), \
        "python -m experiments.report_page docs/report-smollm2.md rewrites it"


def test_slimkv_is_judged_only_against_a_snapkv_pooled_the_same_way():
    # SlimKV finds 8 of 10, SnapKV avg-pooled none: paired differences eight 1s and two 0s, mean 0.8, sample variance
    # (8 * 0.2^2 + 2 * 0.8^2) / 9 = 0.1778, standard error sqrt(0.1778 / 10) = 0.1333: 6 s.e., holds
    rows = (records("slimkv@0.5", SLIM.format("avg"), [1] * 8 + [0] * 2)
            + records("snapkv-avg@0.5", SNAP.format("avg"), [0] * 10)
            + records("snapkv@0.5", SNAP.format("max"), [1] * 10))
    (matched,) = compare.slimkv_claims(rows)  # judged against its matched SnapKV alone
    assert "`snapkv-avg@0.5`" in matched
    assert "**holds**" in matched and "difference +80.0, s.e. 13.3 (paired over 10 prompts)" in matched
    assert "matched: observation_window 32, kernel 7, pool avg" in matched
    # without the matched one: max-pooled SnapKV finds all ten, SlimKV 2 s.e. behind it, but the pair differs in
    # pooling, so no verdict
    (unmatched,) = compare.slimkv_claims([r for r in rows if r["label"] != "snapkv-avg@0.5"])
    assert "**no verdict**" in unmatched and "pool avg against max" in unmatched
    assert not any(w in unmatched for w in ("**holds**", "**does not hold**", "**inconclusive**"))


def test_a_gap_inside_two_paired_standard_errors_is_inconclusive():
    # differences: one 1 and nine 0s: mean 0.1, variance (0.9^2 + 9 * 0.1^2) / 9 = 0.1, s.e. 0.1: 1 s.e.
    rows = records("slimkv@0.5", SLIM.format("max"), [1] + [0] * 9) + records("snapkv@0.5", SNAP.format("max"), [0] * 10)
    (claim,) = compare.slimkv_claims(rows)
    assert "**inconclusive**" in claim and "difference +10.0, s.e. 10.0" in claim


def test_a_paired_comparison_refuses_samples_the_other_side_lacks():
    with pytest.raises(ValueError, match="different samples"):
        verdicts.paired_gap({("a", 1, 0): 1.0, ("a", 1, 1): 0.0}, {("a", 1, 0): 1.0})
    assert verdicts.paired_gap({0: 1.0, 1: 1.0}, {0: 0.0, 1: 1.0}) == (0.5, 0.5, 2)


def test_the_table_counts_prompts_found_and_the_gap_to_the_full_cache():
    rows = (records("full", "FullCache()", [1, 1, 0, 1]) + records("full", "FullCache()", [1, 0], task="vt")
            + records("tova@0.5", "TOVA(ratio=0.5)", [1, 0, 0, 0]) + records("tova@0.5", "TOVA(ratio=0.5)", [1, 0], "vt"))
    for r in rows:
        r["kv_held"] = 1.0 if r["label"] == "full" else 0.25
    lines = compare.table(rows).splitlines()
    assert lines[0].startswith("| policy | KV held | niah_single_1 (of 4) | vt (of 2) | prompts | all its prompts, % |")
    assert lines[2] == "| full | 1.000 | 3 | 1 | 6 | 67 |  |"
    # TOVA loses two of the full cache's four found prompts over six: -33.3 points; differences 0,-1,0,-1,0,0:
    # variance (2 * (2/3)^2 + 4 * (1/3)^2) / 5 = 0.2667, s.e. sqrt(0.2667 / 6) = 0.2108
    assert lines[3] == "| tova@0.5 | 0.250 | 1 | 1 | 6 | 33 | -33.3 (21.1) |"
    # a run not finished: KNorm has niah_single_1's first two prompts only, found both (the full cache found both):
    # vt blank, its share over its 2 prompts, its difference paired with the full cache's on those two
    part = rows + records("knorm@0.5", "KNorm()", [1, 1])
    assert compare.table(part).splitlines()[4] == "| knorm@0.5 |  | 2 |  | 2 | 100 | +0.0 (0.0) |"


def test_the_page_command_checks_and_rewrites_a_stale_block(tmp_path, capsys):
    run = tmp_path / "runs" / "ruler"
    run.mkdir(parents=True)
    rows = records("full", "FullCache()", [1, 0]) + records("slimkv@0.5", SLIM.format("max"), [1, 1]) \
        + records("snapkv@0.5", SNAP.format("max"), [0, 1])
    (run / "preds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "identity.json").write_text(json.dumps({"--protocol": "agnostic", "--batch": 5, "--seed": 42,
                                                   "--chat-template": "on", "model dtype": "float32",
                                                   "weights": "abc"}))
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n<!-- records: ruler runs/ruler -->\nstale\n<!-- /records -->\n\nprose\n")
    assert report_page.main([str(page), "--check"]) == 1
    assert report_page.main([str(page)]) == 0
    text = page.read_text()
    assert "stale" not in text and text.endswith("<!-- /records -->\n\nprose\n")
    assert "chat template on, protocol agnostic, batch 5" in text and "| slimkv@0.5 |  | 2 | 2 | 100 | +50.0 (50.0) |" in text
    assert report_page.main([str(page), "--check"]) == 0


def test_a_missing_page_or_record_directory_is_one_line(tmp_path, capsys):
    from kvjax import cli

    assert cli.run(report_page.main, [str(tmp_path / "nope.md")], compile_cache=None) == 2
    assert capsys.readouterr().err.strip().endswith("nope.md: no such page")
    page = tmp_path / "page.md"
    page.write_text("<!-- records: ruler runs/absent -->\n<!-- /records -->\n")
    assert cli.run(report_page.main, [str(page)], compile_cache=None) == 2
    assert "runs/absent, which is not a directory" in capsys.readouterr().err


def test_a_block_can_show_only_some_methods(tmp_path):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    rows = (records("full", "FullCache()", [1, 0]) + records("tova@0.5", "TOVA()", [1, 0])
            + records("knorm@0.5", "KNorm()", [0, 0]) + records("tova@0.875", "TOVA()", [0, 0]))
    (run / "preds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "identity.json").write_text(json.dumps({"--protocol": "agnostic", "--batch": 1, "--seed": 0,
                                                   "model dtype": "float32", "weights": "w"}))
    page = tmp_path / "p.md"
    page.write_text("<!-- records: ruler runs/r only=tova -->\n<!-- /records -->\n")
    text = report_page.regenerate(page)
    assert "| tova@0.5 |" in text and "| tova@0.875 |" in text and "| full |" in text and "knorm" not in text
    assert text.startswith("<!-- records: ruler runs/r only=tova -->\nRecords: `runs/r` (6, tova)")
    page.write_text("<!-- records: ruler runs/r nope=1 -->\n<!-- /records -->\n")
    with pytest.raises(Exception, match="nope"):
        report_page.regenerate(page)


def test_a_blocks_plot_is_drawn_when_the_page_is_rewritten_not_when_checked(tmp_path):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    rows = records("full", "FullCache()", [1, 1]) + records("tova@0.5", "TOVA()", [1, 0]) \
        + records("tova@0.875", "TOVA()", [0, 0])
    for r in rows:
        r["kv_held"] = {"full": 1.0, "tova@0.5": 0.5}.get(r["label"], 0.125)
    (run / "preds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "identity.json").write_text(json.dumps({"--protocol": "agnostic", "--batch": 1, "--seed": 0,
                                                   "model dtype": "float32", "weights": "w"}))
    page = tmp_path / "p.md"
    page.write_text("<!-- records: ruler runs/r plot=figs/held.png -->\n<!-- /records -->\n")
    assert report_page.main([str(page), "--check"]) == 1 and not (tmp_path / "figs").exists()
    assert report_page.main([str(page)]) == 0
    assert (tmp_path / "figs" / "held.png").stat().st_size > 1000
    assert "![score against KV bytes held](figs/held.png)" in page.read_text()
    assert report_page.main([str(page), "--check"]) == 0
