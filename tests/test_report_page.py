"""The report page's generated blocks (kvjax.experiments.report_page) against the committed records, and the paired
comparisons they print (kvjax.experiments.ruler.compare) on hand-computed cases."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvjax.errors import NonFiniteError

from kvjax.experiments import report_page, verdicts
from kvjax.experiments.ruler import compare

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
        "python -m kvjax.experiments.report_page docs/report-smollm2.md rewrites it"


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


STREAM = "StreamingLLM(budget=None, sinks=4, ratio={}, positions='absolute', prefill_mode='full')"
MAT = ("ByLayer(split=2, shallow=StreamingLLM(budget=None, sinks=4, ratio={0}, prefill_mode='stream'), "
       "deep=AnchorCache(budget=None, anchor_slots=5, ratio={0}, prefill_mode='stream'))")


def zeroshot_items(policy: str, right: list[int]) -> list[dict]:
    return [{"id": f"task|{policy}|{i}", "policy": policy, "acc": bool(r), "acc_norm": bool(r), "kv_share": 0.5}
            for i, r in enumerate(right)]


def test_the_zeroshot_block_pairs_mat_with_streamingllm_item_by_item(tmp_path):
    run = tmp_path / "zs"
    run.mkdir()
    # StreamingLLM right on items 0-1, MAT on 0-7: paired differences 0,0,1,1,1,1,1,1,0,0: mean 0.6, variance
    # (6 * 0.4^2 + 4 * 0.6^2) / 9 = 0.2667, s.e. sqrt(0.2667 / 10) = 0.163: 3.7 s.e., holds
    rows = (zeroshot_items("FullCache()", [1] * 10) + zeroshot_items(STREAM.format(0.5), [1, 1] + [0] * 8)
            + zeroshot_items(MAT.format(0.5), [1] * 8 + [0, 0]))
    (run / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report_page.zeroshot(run, "zs", items="items.jsonl")
    assert "| 50 | | 2/10 (2/10) | 8/10 (8/10) |" in text
    assert "- at 50 %: **holds** (accuracy, MAT minus StreamingLLM: difference +0.600, s.e. 0.163 (paired over 10 " \
           "items)" in text
    assert "At every share: **holds**." in text
    # a ratio of the sweep that has no records is a row "not run", and leaves "at every share" undecided
    text = report_page.zeroshot(run, "zs", items="items.jsonl", ratios="0.5,0.875")
    assert "| 12.5 | | not run | not run |" in text and "At every share: **inconclusive**." in text


def gate_run(tmp_path, gate_minus_h2o: float, se: float, paper_tokens: float, kept: dict | None = None) -> str:
    run = tmp_path / "gate"
    run.mkdir(exist_ok=True)
    (run / "train_identity.json").write_text(json.dumps({"--batch": 2, "--accum": 1, "--seq-len": 100}))
    (run / "loss.json").write_text(json.dumps([{"step": i} for i in range(10)]))  # 10 x 2 x 100 = 2,000 tokens
    c = {"full": 2.0, "gate": 2.1 + gate_minus_h2o, "streaming": 2.3, "h2o": 2.1}
    (run / "results.json").write_text(json.dumps({
        "windows": 20, "seq_len": 100, "prefix": 75, "baseline_eviction": 0.5, "baseline_eviction_source": "gates",
        "continuation_nll": c, "delta_se": {k: 0.01 for k in c},
        "gate_minus_baseline": {k: {"diff": c["gate"] - c[k], "se": se} for k in ("streaming", "h2o")},
        **({"kept_prefix": kept} if kept else {})}))
    return report_page.gate(run, "gate", paper_tokens=str(paper_tokens))


def test_the_gate_block_judges_the_gates_against_the_best_baseline_and_says_what_training_it_had(tmp_path):
    # the gates lose 0.05 less than H2O (the best baseline), s.e. 0.01: 5 s.e., holds for these gates; trained on
    # 2,000 of the paper's 200,000 tokens (1/100), so the paper's claim is inconclusive
    text = gate_run(tmp_path, -0.05, 0.01, 2e5)
    assert "Trained on 2,000 tokens (0.01 of the paper's 200,000)" in text
    assert "here h2o): **holds** for this variant; the paper's claim, **inconclusive** (difference +0.0500" in text
    # the same numbers with the paper's training: the claim itself is decided
    assert "here h2o): **holds** (difference +0.0500" in gate_run(tmp_path, -0.05, 0.01, 2e3)
    # the gates 0.01 worse with s.e. 0.01: inside the noise
    assert "**inconclusive** for this variant" in gate_run(tmp_path, 0.01, 0.01, 2e5)
    # the baselines at 50 % while the gates keep 82 % of the prompt: not the same cache size, no verdict
    assert "here h2o): **no verdict**, not matched (KV held 0.820 against 0.500" in gate_run(
        tmp_path, -0.05, 0.01, 2e3, kept={"full": 1.0, "gate": 0.82, "streaming": 0.5, "h2o": 0.5})


def test_the_anllm_block_gives_no_verdict_where_full_attention_is_at_chance(tmp_path):
    run = tmp_path / "an"
    run.mkdir()
    (run / "train_identity.json").write_text(json.dumps({"--batch": 1, "--seq-len": 512}))
    (run / "loss.json").write_text(json.dumps([{"step": i} for i in range(150)]))
    row = {"items": 40, "L_d": 51.0, "L_kv": 5.0, "chance": 0.25, "T_up_vs_full_caching": 1.0, "data": "facts"}
    (run / "base.json").write_text(json.dumps(row | {"acc_full": 0.9, "acc_ansan": 0.0}))
    # 2 binomial s.e. of 40 items at chance: 2 sqrt(0.25 x 0.75 / 40) = 0.137, so 0.35 is within them
    (run / "ep.json").write_text(json.dumps(row | {"acc_full": 0.35, "acc_ansan": 0.35}))
    text = report_page.anllm(run, "an", paper_tokens="1e9", base="base.json", trained="ep.json")
    assert "| trained | 0.350 (14/40) | 0.350 (14/40) | 5 / 51 | x1.00 |" in text
    assert "**no verdict**: full attention's accuracy (0.350) is within 2 binomial standard errors of chance" in text
    # far above chance and AnSAN 0.5 below it: the margin left is 0.05 - 0.5 = -0.45, s.e. sqrt((.45 x .55 +
    # .05 x .95) / 40) = 0.0859: 5.2 s.e., does not hold for this variant
    (run / "ep.json").write_text(json.dumps(row | {"acc_full": 0.95, "acc_ansan": 0.45}))
    text = report_page.anllm(run, "an", paper_tokens="1e9", base="base.json", trained="ep.json")
    assert "**does not hold** for this variant; the paper's claim, **inconclusive** (the margin left, AnSAN minus " \
           "full plus 0.05: difference -0.450, s.e. 0.086 (unpaired, 40 items each)" in text


def test_the_kvpress_block_counts_agreement_from_the_answers(tmp_path):
    run = tmp_path / "agree"
    run.mkdir()
    (run / "identity.json").write_text(json.dumps({"--chat-template": True, "--protocol": "agnostic"}))
    rows = [{"method": "full", "ratio": None, "task": "niah_single_1", "index": 0, "kvjax": "1.", "kvpress": "1.",
             "same": True, "kvjax_score": 1.0, "kvpress_score": 1.0},
            {"method": "tova", "ratio": 0.5, "task": "niah_single_1", "index": 0, "kvjax": "1.", "kvpress": "2.",
             "same": False, "kvjax_score": 1.0, "kvpress_score": 0.0}]
    (run / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report_page.kvpress(run, "agree")
    assert "(2 answers; niah_single_1: 1 prompts; chat template on, protocol agnostic)" in text
    assert "kvpress gives kvjax's answer in **1 of 2**" in text
    assert "| tova | 0.5 | 1 | 0 | 1 | 0 | TOVAPress |" in text and "| tova | 0.5 | niah_single_1 | 0 | '1.' | '2.' |" in text


def test_versus_claims_pair_two_methods_at_each_ratio_both_ran():
    # KVzip finds 8 of 10 at 0.5 and SnapKV 2 of 10 (the same first two): differences six 1s and four 0s, mean 0.6,
    # variance (6 x 0.4^2 + 4 x 0.6^2) / 9 = 0.2667, s.e. 0.163: 3.7 s.e., holds. At 0.875 only KVzip ran.
    rows = (records("kvzip@0.5", "KVzip(ratio=0.5)", [1] * 8 + [0] * 2)
            + records("snapkv@0.5", SNAP.format("max"), [1, 1] + [0] * 8)
            + records("kvzip@0.875", "KVzip(ratio=0.875)", [1] * 10)
            + records("kvzip@0.5", "KVzip(ratio=0.5)", [1], task="vt"))  # a prompt SnapKV has not run: not paired
    for r in rows:
        r["kv_held"] = 0.5
    (claim,) = compare.versus_claims(rows, [("kvzip", "snapkv")])
    assert claim == ("kvzip >= snapkv at 0.5: **holds** (in points, difference +60.0, s.e. 16.3 (paired over 10 "
                     "prompts): 3.7 s.e., decided beyond 2 s.e.; KV held 0.500 against 0.500)")
    assert compare.versus_claims(rows, [("snapkv", "tova")]) == ["snapkv >= tova: **no verdict**, no ratio where both ran"]
    apart = records("tova@0.5", "TOVA()", [1], task="vt") + records("knorm@0.5", "KNorm()", [1])
    assert compare.versus_claims(apart, [("tova", "knorm")]) == ["tova >= knorm at 0.5: **no verdict**, no prompt both ran"]


PK_FULL = "FullCache(positions='absolute', prefill_mode='full')"
PK_STREAM = "StreamingLLM(budget=3243, sinks=4, positions='absolute', prefill_mode='full')"
PK_RAZOR = "RazorAttention(retrieval=((True, False),), buffer=256, sinks=4, compression=5)"


def passkey_samples(run: Path, found: dict[str, list[int]], length: int = 4096) -> None:
    """samples.jsonl as `kvjax.experiments.passkey` writes it: 10 prompts per policy (depths 0 .. 1 x 2 samples)."""
    run.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"{pol}|{length}|{(i // 2) / 4}|{i % 2}", "policy": pol, "length": length, "depth": (i // 2) / 4,
             "key": 12345, "needle_at": 0, "output": "", "correct": bool(c), "kv_held": held}
            for pol, held in ((PK_FULL, 1.0), (PK_STREAM, 0.79), (PK_RAZOR, 0.4)) if pol in found
            for i, c in enumerate(found[pol])]
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_passkey_block_counts_keys_by_depth_and_pairs_razor_with_a_baseline(tmp_path):
    # Razor finds 8 of 10 and StreamingLLM 2, each of StreamingLLM's among Razor's: the paired differences are six
    # 1s and four 0s, mean 0.6, sample s.d. sqrt((6 x 0.16 + 4 x 0.36) / 9) = 0.5164, s.e. 0.1633: 60.0 points,
    # s.e. 16.3, 3.7 s.e., holds
    passkey_samples(tmp_path / "pk", {PK_FULL: [1] * 8 + [0] * 2, PK_RAZOR: [1] * 8 + [0] * 2,
                                      PK_STREAM: [0, 0, 1, 1, 0, 0, 0, 0, 0, 0]})
    text = report_page.passkey(tmp_path / "pk", "pk", versus="razor:streaming,razor:full")
    assert "| RazorAttention | 8 / 10 | 0.4000 |" in text and "| StreamingLLM(3243) | 2 / 10 | 0.7900 |" in text
    assert "| StreamingLLM(3243) | 4096 | 0 | 100 | 0 | 0 | 0 |" in text  # depth 0.25's two prompts
    assert ("- RazorAttention >= StreamingLLM(3243) at 4096 tokens: **holds** (keys found, in points, difference "
            "+60.0, s.e. 16.3 (paired over 10 prompts)") in text
    assert "KV held 0.4000 against 0.7900" in text
    # the same answers as the full cache: a zero difference with no spread is a tie, not a verdict
    assert "- RazorAttention >= full cache at 4096 tokens: **inconclusive**" in text
    with pytest.raises(report_page.InvalidInput, match="versus=razor:h2o"):
        report_page.passkey(tmp_path / "pk", "pk", versus="razor:h2o")


def test_the_quantization_block_judges_each_width_within_five_percent_over_sequences(tmp_path):
    run = tmp_path / "q"
    passkey_samples(run / "passkey", {PK_FULL: [1] * 8 + [0] * 2})
    full = PK_FULL
    q = lambda bits, extra="": f"Quantized({full}, bits={bits}{extra})"  # noqa: E731
    policies = {"full@16": full, "full@8 (8-bit KV)": q(8, ", residual=0"),
                "full@2 (2-bit KV)": q(2, ", group=32, residual=128")}
    # per-sequence NLLs: 8-bit adds 0.001 and 0.003 (mean 0.002, s.e. 0.001; log 1.05 - 0.002 = 0.0468, 47 s.e.:
    # holds); 2-bit adds 0.20 and 0.22 (mean 0.21, s.e. 0.01; 0.0488 - 0.21 = -0.1612, 16 s.e.: does not hold)
    nll = {"full@16": [2.0, 3.0], "full@8 (8-bit KV)": [2.001, 3.003], "full@2 (2-bit KV)": [2.2, 3.22]}
    ppl = {k: {"2048": float(np.exp(np.mean(v)))} for k, v in nll.items()}
    (run / "perplexity").mkdir(parents=True)
    (run / "perplexity" / "results.json").write_text(json.dumps(
        {"ppl": ppl, "nll_per_sequence": {k: {"2048": v} for k, v in nll.items()}, "policies": policies}))
    text = report_page.quantization(run, "q")
    assert "(2 sequence(s) of 2048 tokens" in text
    assert "| KIVI 2-bit, G 32, R 128 | 15.03 (+23.4 %) |" in text  # exp(2.71) / exp(2.5)
    assert "- full cache, int8 per token: **holds** (12.21 against 12.18; difference +0.0468, s.e. 0.0010" in text
    assert "- full cache, KIVI 2-bit, G 32, R 128: **does not hold** (15.03 against 12.18; difference -0.1612, " \
           "s.e. 0.0100 (paired over 2 sequences)" in text
    assert "| full cache | 8 / 10 |" in text  # the passkey table beside it


def test_the_passkey_block_tells_razor_head_tables_apart_only_when_labelled(tmp_path):
    """RazorAttention Table 1's controls are three RazorAttention policies: one name would merge their records, so
    the block refuses them unlabelled and names each by `label=`."""
    run = tmp_path / "t1"
    tables = {"aaaa1111: 22/90": [1] * 6 + [0] * 4, "bbbb2222: 22/90": [1] * 2 + [0] * 8, "cccc3333: 0/90": [0] * 10}
    rows = [{"id": f"{t}|8184|{(i // 2) / 4}|{i % 2}", "policy": f"RazorAttention(retrieval {t} KV heads kept whole, "
             "compression=inf)", "length": 8184, "depth": (i // 2) / 4, "correct": bool(c), "kv_held": 0.5}
            for t, found in tables.items() for i, c in enumerate(found)]
    run.mkdir()
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(report_page.InvalidInput, match="two policies are named 'razor'"):
        report_page.passkey(run, "t1")
    text = report_page.passkey(run, "t1", versus="retrieval:random,retrieval:none",
                               label="aaaa1111:retrieval,bbbb2222:random,cccc3333:none")
    assert "| RazorAttention(22/90 KV heads whole) [retrieval] | 6 / 10 | 0.5000 |" in text
    assert "| RazorAttention(0/90 KV heads whole) [none] | 0 / 10 | 0.5000 |" in text
    # retrieval 6, random 2 (a subset): four 1s, six 0s: mean 0.4, s.d. sqrt((4 x 0.36 + 6 x 0.16) / 9) = 0.5164,
    # s.e. 0.1633: 40.0 points, 2.4 s.e.
    assert "at 8184 tokens: **holds** (keys found, in points, difference +40.0, s.e. 16.3 (paired over 10 prompts)" \
        in text


def test_the_quantization_block_refuses_a_perplexity_that_is_not_finite(tmp_path):
    run = tmp_path / "q" / "perplexity"
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({
        "ppl": {"full@16": {"2048": 12.0}, "full@2 (2-bit KV)": {"2048": float("nan")}},
        "nll_per_sequence": {"full@16": {"2048": [2.5]}, "full@2 (2-bit KV)": {"2048": [float("nan")]}},
        "policies": {"full@16": PK_FULL, "full@2 (2-bit KV)": f"Quantized({PK_FULL}, bits=2)"}}))
    with pytest.raises(NonFiniteError, match="holds a non-finite number"):  # refused as its file is read
        report_page.quantization(tmp_path / "q", "q")


def needle_cells(run: Path, answers: dict[str, list[str]]) -> None:
    """cells.jsonl as `kvjax.experiments.needle` writes it: one prompt per label and depth (0, 50, 100) at 4096 tokens."""
    run.mkdir(parents=True, exist_ok=True)
    pols = {"full": PK_FULL, "razor": PK_RAZOR, "streaming": PK_STREAM}
    rows = [{"id": f"{lab}|{d}", "label": lab, "policy": pols[lab], "length": 4096, "depth": float(d),
             "answer": a, "exact": "Ravendor" in a, "kv_held": 0.5}
            for lab, got in answers.items() for d, a in zip((0, 50, 100), got)]
    (run / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "identity.json").write_text(json.dumps({"--answer": "Ravendor", "--protocol": "aware",
                                                   "model dtype": "float32", "weights": "abc"}))


def test_the_needle_block_shows_each_answer_and_where_a_policy_leaves_the_full_caches(tmp_path):
    needle_cells(tmp_path / "n", {"full": [" Ravendor.", "", " Ravendor."],
                                  "razor": [" Ravendor.", "", " Ravendor."],
                                  "streaming": [" Ravendom.", "", " Ravendor."]})
    text = report_page.needle(tmp_path / "n", "n", versus="razor:streaming")
    assert "| StreamingLLM(3243) | 4096 | Ravendom. | (empty) | **Ravendor.** | 1 / 3 | 0.5000 |" in text
    assert "- razor: the full cache's answer, word for word, in 3 of its cells\n" in text
    assert "- streaming: the full cache's answer, word for word, in 2 of its cells; not at 4096 tokens depth 0" in text
    # differences 1, 0, 0: mean 1/3, s.d. sqrt((4/9 + 2 x 1/9) / 2) = 0.5774, s.e. 0.3333: 1.0 s.e.
    assert "- razor >= streaming at 4096 tokens: **inconclusive** (exact matches, difference +0.333, s.e. 0.333 " \
           "(paired over 3 prompts)" in text
    with pytest.raises(report_page.InvalidInput, match="versus=razor:h2o"):
        report_page.needle(tmp_path / "n", "n", versus="razor:h2o")


def longbench_run(run: Path, preds: dict[str, list[str]], scores: dict[str, float]) -> None:
    """A LongBench-format run as `kvjax.experiments.longbench` writes it: one passkey task (metric first_number, answer
    "11"), 10 samples, the predictions of each label and result.json's scores."""
    pols = {"full": PK_FULL, "slimkv": SLIM.format("avg"), "snapkv": SNAP.format("max"),
            "snapkv-avg": SNAP.format("avg")}
    for lab, got in preds.items():
        (run / "preds" / lab).mkdir(parents=True)
        (run / "preds" / lab / "stdlib_passkey.jsonl").write_text("".join(
            json.dumps({"_id": f"p-{i}", "pred": p, "answers": ["11"], "all_classes": None, "length": 3000}) + "\n"
            for i, p in enumerate(got)))
    (run / "result.json").write_text(json.dumps({
        "datasets": ["stdlib_passkey"], "policies": {lab: pols[lab] for lab in preds}, "slugs": {lab: lab for lab in preds},
        "scores": {lab: {"stdlib_passkey": {"metric": "first_number", "score": scores[lab]}} for lab in preds},
        "kv_held": {lab: 0.25 for lab in preds}}))
    (run / "identity.json").write_text(json.dumps({"--chat": True, "--protocol": "aware", "--batch": 8,
                                                   "model dtype": "float32", "weights": "abc", "harness config": "h"}))


def test_the_longbench_block_pairs_samples_and_says_what_a_comparison_matches(tmp_path):
    right, wrong = " 11. The", " 12"
    longbench_run(tmp_path / "lb", {"full": [right] * 10, "slimkv": [right] * 2 + [wrong] * 8,
                                    "snapkv": [right] * 10, "snapkv-avg": [right] * 3 + [wrong] * 7},
                  {"full": 100.0, "slimkv": 20.0, "snapkv": 100.0, "snapkv-avg": 30.0})
    text = report_page.longbench(tmp_path / "lb", "lb", versus="slimkv:snapkv-avg,slimkv:snapkv")
    assert "| stdlib_passkey | first_number | 100.0 | 20.0 | 100.0 | 30.0 |" in text
    # against SnapKV avg-pooled (SlimKV's 2 among its 3): one -100, nine 0: mean -10, s.e. 10: inconclusive
    assert "- slimkv >= snapkv-avg on the suite's average: **inconclusive** (difference -10.0, s.e. 10.0 (paired " \
           "over 10 samples): 1.0 s.e., decided beyond 2 s.e.; matched: budget None, observation_window 32, kernel " \
           "7, pool avg)" in text
    # against max-pooled SnapKV: eight -100, two 0: mean -80, s.d. sqrt((8 x 400 + 2 x 6400) / 9) = 42.16,
    # s.e. 13.3, six standard errors, but the pooling differs: no verdict, the pooling named
    assert "- slimkv >= snapkv on the suite's average: **no verdict**, not matched (pool avg vs max) (difference " \
           "-80.0, s.e. 13.3" in text
    assert "matched: budget None, observation_window 32, kernel 7; NOT matched: pool avg vs max)" in text


def test_the_longbench_block_refuses_predictions_that_do_not_give_the_recorded_score(tmp_path):
    longbench_run(tmp_path / "lb", {"full": [" 11"] * 10}, {"full": 90.0})
    with pytest.raises(report_page.InvalidInput, match="full on stdlib_passkey: the predictions do not give"):
        report_page.longbench(tmp_path / "lb", "lb")


def test_a_longbench_tie_at_zero_is_inconclusive_and_no_task_the_full_cache_fails_counts_as_done(tmp_path):
    """On SmolLM2 both SlimKV and SnapKV can find nothing (0 vs 0): a tie is not "holds"; and a task the full
    cache scores 0 on is no test of either, so no claim is made over "the tasks the full cache does"."""
    longbench_run(tmp_path / "lb", {"full": [" 12"] * 10, "slimkv": [" 12"] * 10, "snapkv-avg": [" 12"] * 10},
                  {"full": 0.0, "slimkv": 0.0, "snapkv-avg": 0.0})
    (claim,) = report_page.longbench_claims(tmp_path / "lb", "lb", "slimkv:snapkv-avg")
    assert claim.startswith("slimkv >= snapkv-avg on the suite's average: **inconclusive** (difference +0.0, s.e. 0.0")


def test_the_memory_block_gives_the_growth_per_token_and_the_base_it_implies(tmp_path):
    """Section 5's measurements: 1.70 GB at 2048 x 1, 3.59 GB at 2048 x 8 and 2.50 GB at 8000 x 1. Growth:
    (3.59 - 1.70) GB / (7 x 2048) = 131.8 KB and (2.50 - 1.70) GB / 5952 = 134.4 KB, mean 133.1 KB; base
    1.70 GB - 2048 x 133.1 KB = 1.43 GB; 8 x 8000 tokens: 1.43 + 64000 x 133.1 KB = 9.95 GB. SmolLM2's cache:
    30 x 3 x 64 x 2 x 4 bytes = 46 KB a token."""
    cmd = "python -m kvjax.experiments.passkey --model smollm2"
    cells = [{"command": cmd, "prompt_tokens": t, "prompts": n, "peak_rss_bytes": int(gb * 1e9)}
             for t, n, gb in ((2048, 1, 1.70), (2048, 8, 3.59), (8000, 1, 2.50))]
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "rss.json").write_text(json.dumps({"dtype": "float32", "layers": 30, "kv_heads": 3,
                                                         "head_dim": 64, "machine": "x", "python": "3.11",
                                                         "cells": cells}))
    text = report_page.memory(tmp_path / "m", "m")
    assert f"| `{cmd}` | 8 | 2048 | 3.59 GB |" in text
    assert "132 KB (3.59 GB - 1.70 GB over 14336 tokens); 134 KB (2.50 GB - 1.70 GB over 5952 tokens)" in text
    assert "Their mean, 133 KB a token, over a base of 1.43 GB" in text
    assert "the full cache itself is 46 KB a token" in text and "8 prompts of 8000 tokens in one batch need about " \
        "9.95 GB" in text


def gate_zeroshot_run(run: Path, right: dict[str, list[int]], streaming_held: float = 0.5) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "train_identity.json").write_text(json.dumps({"--batch": 2, "--accum": 1, "--seq-len": 100}))
    (run / "loss.json").write_text(json.dumps([{"step": i} for i in range(10)]))  # 2,000 tokens
    pols = {"full": (PK_FULL, 1.0), "gate": ("GateEviction(bucket=64, kept=None)", 0.9),
            "streaming": ("StreamingLLM(budget=None, sinks=4, ratio=0.5)", streaming_held)}
    (run / "zeroshot").mkdir()
    (run / "zeroshot" / "items.jsonl").write_text("".join(
        json.dumps({"id": f"builtin|{pols[k][0]}|{i}", "policy": pols[k][0], "acc": bool(a), "acc_norm": bool(a),
                    "kv_share": pols[k][1], "logprobs": [0.0] * 4}) + "\n" for k, v in right.items()
        for i, a in enumerate(v)))


def test_the_gate_zeroshot_block_pairs_the_gates_with_each_baseline_and_needs_a_task_above_chance(tmp_path):
    # 20 items: the full cache 16, the gates 15, StreamingLLM 5 (each of its among the gates'): ten 1s and ten 0s,
    # mean 0.5, s.d. sqrt(20 x 0.25 / 19) = 0.513, s.e. 0.115: 4.4 s.e.; trained on 2,000 of 200,000 tokens
    right = {"full": [1] * 16 + [0] * 4, "gate": [1] * 15 + [0] * 5, "streaming": [1] * 5 + [0] * 15}
    gate_zeroshot_run(tmp_path / "g", right, streaming_held=0.895)
    text = report_page.gate_zeroshot(tmp_path / "g", "g", paper_tokens="2e5")
    assert "(20 items of builtin, chance 0.25). Trained on 2,000 tokens (0.01 of the paper's 200,000)." in text
    assert "| gate | 0.900 | 15/20 | 15/20 |" in text
    assert "- gates >= streaming: **holds** for this variant; the paper's claim, **inconclusive** (accuracy, " \
           "difference +0.500, s.e. 0.115 (paired over 20 items): 4.4 s.e." in text and "KV held 0.900 against 0.895)" in text
    # the same answers with StreamingLLM holding half the cache: a larger cache against a smaller one decides nothing
    gate_zeroshot_run(tmp_path / "u", right, streaming_held=0.5)
    assert "- gates >= streaming: **no verdict**, not matched (KV held 0.900 against 0.500, more than 0.01 apart)" \
        in report_page.gate_zeroshot(tmp_path / "u", "u", paper_tokens="2e5")
    # the full cache at 7 of 20 (chance 0.25 + 2 x 0.097 = 0.44): the task does not test the cache
    gate_zeroshot_run(tmp_path / "h", {**right, "full": [1] * 7 + [0] * 13}, streaming_held=0.895)
    assert "- gates >= streaming: **no verdict**: the full cache's accuracy" in report_page.gate_zeroshot(
        tmp_path / "h", "h", paper_tokens="2e5")


def test_blocks_refuse_what_they_cannot_state(tmp_path):
    """A projection that is not TOKENSxPROMPTS, and zero-shot items without a measured KV share (stream scoring),
    are one-line errors; a LongBench pair may name the full cache, which has no budget (shown as "-")."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "rss.json").write_text(json.dumps({"dtype": "float32", "layers": 1, "kv_heads": 1, "head_dim": 2,
                                                         "machine": "x", "python": "3.11", "cells": [
        {"command": "c", "prompt_tokens": 10, "prompts": 1, "peak_rss_bytes": 100},
        {"command": "c", "prompt_tokens": 20, "prompts": 1, "peak_rss_bytes": 200}]}))
    with pytest.raises(report_page.InvalidInput, match="project=8000 is not TOKENSxPROMPTS"):
        report_page.memory(tmp_path / "m", "m", project="8000")
    gate_zeroshot_run(tmp_path / "g", {"full": [1] * 4, "gate": [1] * 4, "streaming": [0] * 4}, streaming_held=None)
    with pytest.raises(report_page.InvalidInput, match="without its measured KV share"):
        report_page.gate_zeroshot(tmp_path / "g", "g", paper_tokens="2e5")
    longbench_run(tmp_path / "lb", {"full": [" 11"] * 10, "snapkv": [" 11"] * 10}, {"full": 100.0, "snapkv": 100.0})
    (claim, _) = report_page.longbench_claims(tmp_path / "lb", "lb", "snapkv:full")
    assert "**no verdict**, not matched (budget None vs -, observation_window 32 vs -" in claim


def perplexity_run(run: Path, budget: int, nll: dict[tuple[str, int | None], list[float]], tuning: str,
                   length: int = 64, results_ppl: dict | None = None) -> None:
    """A perplexity run directory: per (label, β) the NLL of each window, its identity and results.json."""
    run.mkdir(parents=True)
    ident = {"weights": "w", "model dtype": "float32", "--anchor-grid": "auto" if tuning else None,
             "--anchor-tuning": tuning}
    (run / "identity.json").write_text(json.dumps(ident if budget else {k: ident[k] for k in list(ident)[:2]}))
    recs = []
    for (lab, beta), xs in nll.items():
        pol = (f"ByLayer(split=2, deep=AnchorCache(budget={budget}, anchor_slots={beta}))" if beta
               else f"StreamingLLM(budget={budget})" if lab == "streaming" else "FullCache()")
        recs += [{"id": f"{pol}|{length}|{i}", "label": lab, "policy": pol, "length": length, "sequence": i,
                  "nll": x, "ppl": float(np.exp(x))} for i, x in enumerate(xs)]
    (run / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "results.json").write_text(json.dumps({"ppl": results_ppl or {}}))


def test_the_perplexity_block_scores_each_sequence_at_the_beta_the_others_chose(tmp_path):
    """Hand-computed: β 1 is best on sequences 0 and 2 and worst on 1, so leave-one-out gives β 3, 1, 3 and MAT's
    NLLs 2.0, 5.0, 2.0 (perplexity e^3); StreamingLLM's 2.0, 2.2, 2.4 (e^2.2). StreamingLLM minus MAT: 0, -2.8, 0.4,
    mean -0.8, paired s.e. sqrt(6.08 / 2 / 3) = 1.0066: inconclusive. At budget 16 MAT is below by 0.5, 0.5, 0.4:
    mean 0.4667, s.e. sqrt(0.00667 / 2 / 3) = 0.0333, holds."""
    run = tmp_path / "ppl"
    perplexity_run(run / "full", 0, {("full", None): [1.5, 1.5, 1.5]}, None)
    perplexity_run(run / "rolling-8", 8, {("streaming", None): [2.0, 2.2, 2.4], ("mat", 1): [1.0, 5.0, 1.0],
                                          ("mat", 3): [2.0, 0.0, 2.0]}, "leave-one-out",
                   results_ppl={"streaming": {"64": float(np.exp(2.2))}, "mat": {"64": float(np.exp(3.0))}})
    s16 = [3.0] * 3
    m16 = [2.5, 2.5, 2.6]
    perplexity_run(run / "rolling-16", 16, {("streaming", None): s16, ("mat", 2): m16, ("mat", 4): [9.0] * 3},
                   "leave-one-out",
                   results_ppl={"streaming": {"64": float(np.exp(3.0))}, "mat": {"64": float(np.exp(np.mean(m16)))}})
    text = report_page.perplexity(run, "ppl")
    assert "| 8 | 9.03 | 20.09 | 3, 1, 3 | -0.8000 |" in text
    assert "budget 8: **inconclusive** (log-perplexity, StreamingLLM minus MAT: difference -0.8000, s.e. 1.0066" in text
    assert "| 16 | 20.09 | 12.60 | 2, 2, 2 | +0.4667 |" in text
    assert "budget 16: **holds** (log-perplexity, StreamingLLM minus MAT: difference +0.4667, s.e. 0.0333" in text
    assert "- budget 8: β 1: 10.31; β 3: 3.79" in text and "| full cache (64) | 4.48 | 4.48 | | |" in text
    # a results.json that is not what its records give is refused
    bad = json.loads((run / "rolling-8" / "results.json").read_text())
    bad["ppl"]["mat"]["64"] = float(np.exp(2.0))  # MAT at each sequence's own best β
    (run / "rolling-8" / "results.json").write_text(json.dumps(bad))
    with pytest.raises(report_page.InvalidInput, match="rolling-8: results.json's mat perplexity"):
        report_page.perplexity(run, "ppl")


def test_the_perplexity_block_states_what_it_cannot_read_in_one_line(tmp_path):
    """MAT at one β, untuned, is that β on every sequence; a β missing a sequence, a run without StreamingLLM, and
    budgets tuned two ways are each one error naming the directory."""
    run = tmp_path / "ppl"
    perplexity_run(run / "full", 0, {("full", None): [1.5, 1.5]}, None)
    perplexity_run(run / "rolling-8", 8, {("streaming", None): [2.0, 2.2], ("mat", 4): [1.9, 2.0]}, None,
                   results_ppl={"streaming": {"64": float(np.exp(2.1))}, "mat": {"64": float(np.exp(1.95))}})
    assert "| 8 | 8.17 | 7.03 | 4, 4 | +0.1500 |" in report_page.perplexity(run, "ppl")
    assert "MAT's β: one value, not tuned." in report_page.perplexity(run, "ppl")
    perplexity_run(run / "rolling-16", 16, {("streaming", None): [2.0, 2.2], ("mat", 1): [1.9, 2.0],
                                            ("mat", 2): [1.9]}, "leave-one-out")
    with pytest.raises(report_page.InvalidInput, match=r"rolling-16: MAT at β 2 has sequences \[0\], not \[0, 1\]"):
        report_page.perplexity(run, "ppl")
    (run / "rolling-16" / "runs.jsonl").write_text("".join(
        line for line in (run / "rolling-16" / "runs.jsonl").read_text().splitlines(keepends=True)
        if '"mat"' in line and "anchor_slots=1" in line))
    with pytest.raises(report_page.InvalidInput, match="rolling-16: no StreamingLLM records"):
        report_page.perplexity(run, "ppl")


def test_the_anllm_placements_block_pairs_table_3s_placements_item_by_item(tmp_path):
    """AnLLM-AC's Table 3 on 4 items (chance 0.5, two options): full attention right on all 4 at every placement;
    AnSAN right on items 0-3 with <AC> after each demonstration, on 0-1 every 10 tokens, on none at random. Every
    demonstration minus every 10 tokens: 0, 0, 1, 1, mean 0.5, s.e. sqrt(1/3 / 4) = 0.289: inconclusive; minus
    random: 1 on each of 4 items, s.e. 0, 4 items too few for the sign test: inconclusive. Table 1's claim: no
    verdict, as 4 items put chance + 2 s.e. at 0.5 + 2 x 0.25 = 1, full attention's own accuracy."""
    run = tmp_path / "ac"
    run.mkdir()
    (run / "train_identity.json").write_text(json.dumps({"--batch": 1, "--seq-len": 512}))
    (run / "loss.json").write_text(json.dumps([{"step": i} for i in range(10)]))
    ansan_right = {"sentence": [1, 1, 1, 1], "every-10": [1, 1, 0, 0], "random-0.1": [0, 0, 0, 0]}
    for p, got in ansan_right.items():
        d = run / f"eval-absent-{p}"
        d.mkdir()
        items = [{"i": i, "answer": 1, "full": [0.0, 1.0], "ansan": [0.0, 1.0] if ok else [1.0, 0.0]}
                 for i, ok in enumerate(got)]
        (d / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
        (d / "results.json").write_text(json.dumps({"items": 4, "L_d": 51.0, "L_kv": 5.0 + 2 * len(p), "chance": 0.5,
                                                    "acc_full": 1.0, "acc_ansan": sum(got) / 4, "data": "facts"}))
    text = report_page.anllm_placements(run, "ac", paper_tokens="1e9")
    assert "| every 10 tokens | 1.000 (4/4) | 0.500 (2/4) | 21 / 51 |" in text
    assert "every demonstration >= every 10 tokens (AnSAN accuracy): **inconclusive** for this variant" in text
    assert "difference +0.500, s.e. 0.289 (paired over 4 items)" in text
    assert "every demonstration >= random, p = 0.1 (AnSAN accuracy): **inconclusive**" in text
    assert "difference +1.000, s.e. 0 (paired over 4 items): every difference the same, decided by the sign test" in text
    assert "Trained on 5,120 tokens" in text
    assert "- Table 1's claim (AnSAN within 0.05 of full attention's accuracy): **no verdict**" in text
    # a results.json that is not what its items give is refused
    bad = run / "eval-absent-every-10" / "results.json"
    bad.write_text(bad.read_text().replace('"acc_ansan": 0.5', '"acc_ansan": 0.75'))
    with pytest.raises(report_page.InvalidInput, match="eval-absent-every-10: results.json's acc_ansan"):
        report_page.anllm_placements(run, "ac", paper_tokens="1e9")
