"""The papers' main tables in miniature on one model: runs the suites x policies and writes one report.

    python -m kvjax.experiments.report [--model DIR] [--budget 256] [--budgets 128,256,512] [--out results/report]

By default the model is kvjax-small (kvjax/models/small; the 0.52 M default if it is missing). The model is
loaded once and each section calls its suite as a function (`kvjax.experiments.driver`: typed options,
a `SuiteResult` back) into OUT/<section>/, so an interrupted report resumes cell by cell. Each
section states the protocol that makes its comparison fair:
1. MAT vs StreamingLLM perplexity at equal budget, at every budget of --budgets, in and beyond the
   trained window, both with rolling positions (MAT Table 3);
2. RazorAttention vs StreamingLLM vs H2O on passkey retrieval **at equal cache bytes** (RazorAttention's
   Table 1 task, which a small model does with its full cache, unlike the needle's free-text fact):
   Razor's local heads keep --budget tokens, and StreamingLLM and H2O get the token budget that holds
   as many slots as Razor's cache at the longest length (`kvjax.drive.equal_bytes_budget`), since
   Razor's retrieval heads keep the whole prompt; retrieval heads from the model's heads.json or
   `kvjax.experiments.find_heads`;
3. SlimKV vs SnapKV (and the baselines) on the LongBench-format suite at every budget of --budgets
   (SlimKV Table 1);
4. SlimKV vs SnapKV with PyramidKV, H2O, StreamingLLM, KNorm and TOVA on RULER (kvpress's
   question-agnostic protocol) at --ruler-ratios, a share of each prompt removed;
5. zero-shot multiple choice with the policy applied to the context (MAT's lm-eval table), and with
   --zeroshot-ratios MAT Table 2's sweep of the KV share;
6. passkey retrieval; 7. efficiency (MAT Table 6).
Then OUT/report.md: every table, the plots, and which claims hold in miniature, worded from the
numbers by one rule (`kvjax.experiments.verdicts`: "holds" or "does not hold" only where the difference is
more than two standard errors from zero, else "inconclusive"; a trained variant's claim states the share
of the paper's training tokens given by --anllm-training-share / --gate-training-share); a comparison
where the full cache does no better than chance (or than the compressed policies) is also said to be
no evidence either way. AnLLM and Attention-Gate need trained variants of the
model: pass `--anllm DIR` (from `kvjax.experiments.eval_anllm`) or `--gate DIR` (from `kvjax.experiments.eval_gate`)
to include their results; without them the report says they were not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kvjax.experiments import cli, driver, efficiency, find_heads, passkey, perplexity, report_page, zeroshot
from kvjax.experiments.common import (
    DEFAULT_MODEL_DIR,
    add_chat_template_arg,
    chat_template_on,
    float_list,
    int_list,
    model_help,
    nonnegative_int,
    positive_int,
)
from kvjax.experiments.records import ResultLog, shown, write_atomic
from kvjax.experiments.verdicts import all_of, binomial_se, evidence, paired_gap, paired_se, trained, verdict
from kvjax.experiments.longbench import __main__ as longbench
from kvjax import engine
from kvjax.policies import REGISTRY, default_shallow_layers, make_policy
from kvjax.models import SMALL_DIR
from kvjax.cli import HelpFormatter


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _binomial(better: float, worse: float, n: int, scale: float = 1.0, **how) -> tuple[str, str]:
    """(verdict, its evidence) of a claim that `better` >= `worse`, two means of n unpaired scores in [0, scale],
    by the shared rule (`kvjax.experiments.verdicts`)."""
    diff, se = better - worse, scale * binomial_se(better / scale, worse / scale, n)
    return verdict(diff, se), evidence(diff, se, paired=False, n=n, **how)


def _log_ppl_gaps(seqs: dict, higher: str, lower: str, length: str) -> list[float]:
    """Per sequence, `higher`'s log-perplexity minus `lower`'s (the records' NLLs; empty if either lacks them)."""
    a, b = seqs.get(higher, {}).get(length) or [], seqs.get(lower, {}).get(length) or []
    return [x - y for x, y in zip(a, b)] if len(a) == len(b) else []


def _evidence(full: float, floor: float, floor_name: str, n: int) -> str:
    """The close of a claim's numbers: a comparison of caches says something only about a task the model
    does with its full cache, i.e. above `floor` (chance, or what the compressed caches score) by more
    than two binomial standard errors of n items (at p = floor, at least 1 / n: 0.14 at chance 0.25 with
    40 items), so a small suite's noise is not read as the model doing the task."""
    margin = 2 * max(math.sqrt(floor * (1 - floor) / n), 1 / n)
    return f"; the full cache is no better than {floor_name}, so this is no evidence either way)" \
        if full <= floor + margin else ")"


def _anllm_gaps(items: Path) -> list[float]:
    """Per item of `kvjax.experiments.eval_anllm`'s items.jsonl, whether AnSAN answered right minus whether full
    attention did (both read the same item); empty where the file is not there."""
    if not items.is_file():
        return []
    rows = [json.loads(line) for line in items.read_text().splitlines() if line.strip()]
    right = lambda row, key: float(int(np.argmax(row[key])) == row["answer"])  # noqa: E731
    return [right(row, "ansan") - right(row, "full") for row in rows]


def _share(text: str) -> float:
    """A share of the paper's training tokens, in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a share in (0, 1]")
    return value


def _evicted(results: dict) -> bool:
    """Whether a compressed cache of a zero-shot table held less than the full cache (an unmeasured share, None,
    may have): where none did, every policy is the full cache and a comparison of them is no evidence."""
    return any(v["kv_share"] is None or v["kv_share"] < 1 for k, v in results.items() if k != "full")


SECTIONS = ("perplexity", "razor", "longbench", "ruler", "zeroshot", "passkey", "efficiency", "quantization")
# The compression baselines of the RULER section (SlimKV Table 1's, with kvpress's TOVA and KNorm).
RULER_POLICIES = ("streaming", "h2o", "snapkv", "pyramidkv", "slimkv", "tova", "knorm")
# The 2026 baselines (AdaKV, ExpectedAttention, KeyDiff, KVzip; DuoAttention from the model's own head scores)
# beside them
RULER_2026 = ("adakv", "expected-attention", "keydiff", "kvzip")
# section 4's sweep: the leaderboard's ratios, to 16:1 and 32:1 (issue 63: 8:1 no longer separates methods)
RULER_RATIOS = (0.25, 0.5, 0.75, 0.875, 0.9375, 0.96875)
# section 4's methods by default, each at every --ruler-ratios (--ruler-methods chooses others)
RULER_METHODS = RULER_POLICIES + RULER_2026 + ("duo", "snapkv-avg", "slimkv-max", "snapkv-kvpress", "slimkv-kvpress")
# the RULER suite's keywords as the report's options name them (its refusals name the flag the user typed)
RULER_FLAGS = {"lengths": "ruler_length", "tasks": "ruler_tasks", "samples": "ruler_samples", "batch": "ruler_batch",
               "chat_template": "chat_template"}
PPL_FLAGS = {"lengths": "ppl_lengths", "text": "ppl_text", "sequences": "ppl_sequences",
             "anchor_grid": "ppl_anchor_grid", "anchor_tuning": "ppl_anchor_tuning"}


def _kvzap_thresholds(args, ratios) -> dict[float, float]:
    """KVzap's threshold at each ratio r of section 4: the one that evicted a share r of its surrogate's held-out
    pairs (`kvjax.experiments.train_kvzap` records them in kvzap.json); a ratio it has none for is an error."""
    from kvjax.surrogate import load

    if args.kvzap is None:
        raise driver.ArgumentError("--ruler-methods kvzap needs its surrogate: --kvzap DIR", usage=False)
    meta = load(args.kvzap)[1]
    known = (meta.get("heldout") or {}).get("threshold_evicting", {})
    missing = [r for r in ratios if f"{r:g}" not in known]
    if missing:
        raise driver.ArgumentError(f"--kvzap {args.kvzap} records no threshold for ratio {missing[0]:g} (it has "
                                   f"{', '.join(known) or 'none'})", usage=False)
    return {r: known[f"{r:g}"] for r in ratios}


# SnapKV and SlimKV at each other's pooling and both at kvpress's SnapKVPress settings (window 64, kernel 5,
# avg-pool): with `snapkv` (its paper's max-pool) and `slimkv` (its own avg-pool), every setting has both scores.
# `adakv-kvpress`: AdaKV on SnapKV at those settings, as kvpress's AdaKVPress(SnapKVPress()) runs by default
# (`kvjax.experiments.kvpress_agreement` compares the two).
MATCHED_POOLING = {"snapkv-avg": {"pool": "avg"}, "slimkv-max": {"pool": "max"},
                   "snapkv-kvpress": {"observation_window": 64, "kernel": 5, "pool": "avg"},
                   "slimkv-kvpress": {"observation_window": 64, "kernel": 5, "pool": "avg"},
                   "adakv-kvpress": {"observation_window": 64, "kernel": 5, "pool": "avg"}}
PASSKEY_SAMPLES = 5  # per prompt length and key depth, in section 2


@dataclasses.dataclass(frozen=True)
class Run:
    """What every section of one report reads: the parser (its errors), the flags, the model loaded once, OUT,
    and the settings derived from the model."""

    p: argparse.ArgumentParser
    args: argparse.Namespace
    lm: Any
    out: Path
    cfg: Any
    n: int  # the model's window
    depth: int  # its layers
    shallow: int  # MAT's L_s
    window: dict  # SnapKV's observation window, where the model's window is short
    ppl_lengths: list[int]


def perplexity_section(run: Run) -> tuple[list[str], list[str]]:
    """Section 1: MAT vs StreamingLLM perplexity at equal budget: (markdown, claims)."""
    p, args, lm, out = run.p, run.args, run.lm, run.out
    n, depth, shallow, ppl_lengths = run.n, run.depth, run.shallow, run.ppl_lengths
    md, claims = [], []
    d = out / "perplexity"
    full = driver.call(p, perplexity.suite, lm, driver.resolve_policies("full"), d / "full",
                       lengths=[x for x in ppl_lengths if x <= n], text=args.ppl_text, flag_names=PPL_FLAGS)
    md += ["## 1. Perplexity with a bounded cache (MAT Table 3)", "", "Full cache (absolute positions):", "",
           full.table, ""]
    for budget in args.budgets:
        pols = driver.resolve_policies("streaming,mat", budget=budget, positions="rolling", shallow_layers=shallow,
                                       num_layers=depth)
        res = driver.call(p, perplexity.suite, lm, pols, d / f"rolling-{budget}", lengths=ppl_lengths,
                          text=args.ppl_text, sequences=args.ppl_sequences, anchor_grid=args.ppl_anchor_grid,
                          anchor_tuning=args.ppl_anchor_tuning, flag_names=PPL_FLAGS)
        roll = res.summary["ppl"]
        beta = ("MAT's β grid-searched per length (`--ppl-anchor-grid`), chosen "
                + ("per sequence on the other sequences" if args.ppl_anchor_tuning == "leave-one-out"
                   else "on a tuning window") if args.ppl_anchor_grid
                else f"MAT's β = {pols['mat'].deep.anchor_slots}, not tuned")
        md += [f"StreamingLLM and MAT at budget {budget} (rolling positions; {args.ppl_sequences} sequence(s) per "
               f"length; {beta}):", "", res.table, "",
               f"![perplexity](perplexity/rolling-{budget}/perplexity.png)", ""]
        # per length, StreamingLLM's log-perplexity minus MAT's (positive: MAT's is lower), paired over the
        # sequences; one sequence has no standard error, so its length is inconclusive whatever the gap
        said, hows = [], []
        for k in [k for k, v in roll["mat"].items() if v is not None and roll["streaming"][k] is not None]:
            gaps = _log_ppl_gaps(res.summary.get("nll_per_sequence", {}), "streaming", "mat", k)
            diff = float(np.mean(gaps)) if gaps else math.log(roll["streaming"][k] / roll["mat"][k])
            se = paired_se(gaps)
            said.append(verdict(diff, se))
            hows.append(f"{k} tokens: log-perplexity " + evidence(diff, se, paired=True, n=max(len(gaps), 1),
                                                                  of="sequences"))
        claims.append(f"MAT's perplexity <= StreamingLLM's at budget {budget} at every length: "
                      f"**{all_of(said)}** (MAT {roll['mat']}, StreamingLLM {roll['streaming']}; full cache in "
                      f"window {full.summary['ppl']['full']}; " + "; ".join(hows) + ")")
    return md, claims


def razor_section(run: Run, heads: Path, kv_mask: np.ndarray) -> tuple[list[str], list[str]]:
    """Section 2: RazorAttention on passkey at equal cache bytes (`kv_mask`: `heads`' retrieval KV heads):
    (markdown, claims)."""
    p, args, lm, out = run.p, run.args, run.lm, run.out
    n = run.n
    md, claims = [], []
    from kvjax.drive import equal_bytes_budget

    d = out / "razor"
    lengths = args.razor_lengths or passkey.default_lengths(lm.tokenizer, n)
    longest = max(lengths)
    razor = driver.resolve_policies("razor", heads=str(heads), buffer=args.budget)["razor"]
    same_bytes = equal_bytes_budget(lm.model, razor, longest, passkey.MAX_NEW_TOKENS)
    pols = driver.resolve_policies("full,streaming,h2o", budget=same_bytes) | {"razor": razor}
    res = driver.call(p, passkey.suite, lm, pols, d, lengths=lengths, samples=args.razor_samples,
                      flag_names={"lengths": "razor_lengths", "samples": "razor_samples"})
    md += [f"The probe's retrieval heads: {int(kv_mask.sum())} of {kv_mask.size} KV heads "
           f"({kv_mask.mean():.0%}; the paper finds about 15 % of query heads), in layers "
           f"{sorted({int(i) for i in np.nonzero(kv_mask.any(axis=1))[0]})}.", ""]
    md += ["## 2. Passkey retrieval (RazorAttention Table 1) at equal cache bytes", "",
           f"RazorAttention's local heads keep {args.budget} tokens (+ 4 sinks and the compensation token) and "
           f"its retrieval heads the whole prompt; at the longest length ({longest} tokens) its cache holds as "
           f"many slots as a {same_bytes}-token budget per layer and KV head, the budget StreamingLLM and H2O "
           "get here. Accuracy % per prompt length and key depth:", "", res.table, "",
           "![passkey at equal bytes](razor/results.png)", ""]
    # the claim at the length where the bytes are equal, paired prompt by prompt against the better baseline there
    records = list(ResultLog(res.out / "samples.jsonl"))
    found = {lab: passkey.found_by_prompt(records, pol.describe(), longest) for lab, pol in pols.items()}
    acc = {lab: round(float(np.mean(list(f.values()))), 3) for lab, f in found.items()}
    best = max(("streaming", "h2o"), key=lambda lab: acc[lab])
    diff, se, items = paired_gap(found["razor"], found[best])
    diff, se = 100 * diff, None if se is None else 100 * se
    claims.append(f"RazorAttention retrieves at least as well as StreamingLLM and H2O at equal cache bytes "
                  f"({longest} tokens, budget {same_bytes}): **{verdict(diff, se, items)}** (keys found {acc}; Razor "
                  f"minus {best}, the better baseline, in points: "
                  + evidence(diff, se, paired=True, n=items, of="prompts", digits=1)
                  + _evidence(acc["full"], acc[best], "StreamingLLM's or H2O's", items))
    return md, claims


def longbench_section(run: Run) -> tuple[list[str], list[str]]:
    """Section 3: SlimKV vs SnapKV on the LongBench-format suite: (markdown, claims)."""
    p, args, lm, out = run.p, run.args, run.lm, run.out
    window = run.window
    md, claims = [], []
    md += ["## 3. LongBench-format suite (SlimKV / SnapKV)", ""]
    for budget in args.longbench_budgets or args.budgets:
        d = out / "longbench" / f"budget-{budget}"
        pols = driver.resolve_policies("full,streaming,h2o-prefill,snapkv,slimkv", budget=budget, **window)
        # SnapKV and SlimKV at each other's pooling and both at kvpress's settings, so that SlimKV's claim is
        # decided on pairs that differ in the score alone (eqs. 3-5); kvpress's window needs a budget that holds it
        kvpress = budget >= MATCHED_POOLING["snapkv-kvpress"]["observation_window"]
        for name in ("snapkv-avg", "slimkv-max") + (("snapkv-kvpress", "slimkv-kvpress") if kvpress else ()):
            base = name.split("-", 1)[0]
            pols[name] = driver.resolve_policies(base, budget=budget, **{**window, **MATCHED_POOLING[name]})[base]
        res = driver.call(p, longbench.suite, lm, pols, d, samples=args.samples, data_dir=args.longbench_data,
                          flag_names={"data_dir": "longbench_data"})
        md += [f"Budget {budget}:", "", res.table, "", f"![longbench](longbench/budget-{budget}/results.png)", ""]
        if not kvpress:
            md += [f"kvpress's settings (window {MATCHED_POOLING['snapkv-kvpress']['observation_window']}) do not "
                   f"fit budget {budget}: SnapKV and SlimKV compared at the paper's and each other's pooling only.", ""]
        claims += [f"LongBench-format suite at budget {budget}: {c}" for c in report_page.longbench_claims(
            d, str(d), "slimkv:snapkv-avg,slimkv-max:snapkv" + (",slimkv-kvpress:snapkv-kvpress" if kvpress else ""))]
    return md, claims


def ruler_section(run: Run) -> tuple[list[str], list[str]]:
    """Section 4: RULER, question-agnostic, at --ruler-ratios: (markdown, claims)."""
    p, args, lm, out = run.p, run.args, run.lm, run.out
    n, depth = run.n, run.depth
    md, claims = [], []
    from kvjax.experiments.ruler import __main__ as ruler, compare

    length = args.ruler_length or min(4096, n)
    tasks = args.ruler_tasks.split(",")

    duo = out / "duo.json"
    if not duo.is_file():  # DuoAttention's head scores on the fly (kvpress's method), on offline text
        from kvjax.experiments.common import default_text
        from kvjax.heads import duo_scores, save_heads

        ids = lm.tokenizer(default_text(), add_special_tokens=False)["input_ids"]
        win = min(1024, n)
        rows = [ids[i:i + win] for i in range(0, 8 * win, win)]
        save_heads(duo, duo_scores=duo_scores(lm.model, rows), duo_texts=len(rows), duo_len=win, sink_size=128,
                   recent_size=256)

    chat = chat_template_on(lm.tokenizer, args.chat_template)  # the prompts' format: kvpress's, from the tokenizer
    replay = driver.kvzip_replay(lm.path, chat=chat)  # KVzip's replay prompts, in the prompts' format

    methods = args.ruler_methods or list(RULER_METHODS)
    unknown = [m for m in methods if m not in REGISTRY and m not in MATCHED_POOLING]
    if unknown:
        raise driver.ArgumentError(f"--ruler-methods {','.join(methods)}: {unknown[0]} is not a policy name or one "
                                   f"of the matched pairs ({', '.join(MATCHED_POOLING)})", usage=False)
    kvzap_thresholds = _kvzap_thresholds(args, args.ruler_ratios) if "kvzap" in methods else {}

    def at_ratios(room):
        pols = {"full": driver.resolve_policies("full")["full"]}
        for r in args.ruler_ratios:
            for name in methods:
                if name in ("duo", "duo-kvpress"):  # a share r of the KV heads made streaming heads
                    pol = driver.resolve_policies(name, duo_pattern=str(duo), head_compression=r)[name]
                elif name == "kvzap":  # the threshold that evicted a share r of the surrogate's held-out pairs
                    pol = make_policy("kvzap", kvzap=args.kvzap, threshold=kvzap_thresholds[r])
                elif name in MATCHED_POOLING:  # SlimKV's claim on matched pairs (issue 65)
                    base = name.split("-", 1)[0]
                    pol = driver.resolve_policies(base, ratio=r, **MATCHED_POOLING[name])[base]
                else:  # KVzip's family replays the prompts' format (`replay`); the others take no replay
                    takes = "replay" in REGISTRY[name].parameters
                    pol = driver.resolve_policies(name, ratio=r, num_layers=depth,
                                                  **({"replay": replay} if takes else {}))[name]
                pols[f"{name}@{r:g}"] = pol
        return pols

    res = driver.call(p, ruler.suite, lm, at_ratios, out / "ruler", lengths=[length], tasks=tasks,
                      flag_names=RULER_FLAGS,
                      samples=args.ruler_samples, protocol="agnostic", batch=args.ruler_batch,
                      chat_template=args.chat_template)
    scores = {lab: row[str(length)] for lab, row in res.summary["average"].items()}
    md += [f"## 4. RULER at {length} tokens, question-agnostic (SlimKV / SnapKV and the baselines)", "",
           f"kvpress's protocol: each context is compressed without its question, which then extends the "
           f"compressed cache; `name@r` removes a share r of each prompt. Tasks {', '.join(tasks)}, "
           f"{args.ruler_samples} samples each (one sample is {100 / args.ruler_samples:.0f} points of a task).",
           "", res.table, ""]
    md += [f"DuoAttention at `duo@r` makes a share r of the KV heads streaming heads (128 sinks + 256 recent "
           f"tokens; the head scores computed on the fly as kvpress does, on 8 windows of the offline text, "
           f"`ruler/../duo.json`), so it keeps more than 1 - r of a {length}-token prompt; its streaming heads slide "
           "through the question and the answer, as the paper's do, where `duo-kvpress@r`'s, as kvpress's "
           "DuoAttentionPress, keep the prompt's window and append every new token; AdaKV runs on SnapKV's "
           "score (its heads' slots in one pool per layer); KVzip's evicted slots are emptied, not freed (its "
           f"replay: {'in the chat template' if chat else 'raw text'}, as the prompts are, chunks of 2048 tokens, "
           "kvpress's prompts). `snapkv-avg` / `slimkv-max` give each the other's pooling and `snapkv-kvpress` / "
           "`slimkv-kvpress` both kvpress's SnapKVPress settings (window 64, kernel 5, avg), so that SlimKV's claim "
           "is decided on pairs that differ in the score alone. `kvzap@r` runs the threshold that evicted a share r "
           "of its surrogate's held-out pairs: what it held on these prompts is its KV held.", ""]
    for r in args.ruler_ratios:
        new = {k: scores.get(f"{k}@{r:g}") for k in ("snapkv", "adakv", "expected-attention", "keydiff", "kvzip",
                                                      "duo")}
        claims.append(f"The 2026 baselines on RULER-{length} at ratio {r:g} (average %): "
                      + ", ".join(f"{k} {v}" for k, v in new.items()) + f"; full {scores['full']}")
    # paired over the section's prompts, matched pairs only (`kvjax.experiments.ruler.compare`)
    claims += [f"RULER-{length}: {c}" for c in compare.slimkv_claims(compare.read(out / "ruler"))]
    return md, claims


def zeroshot_section(run: Run) -> tuple[list[str], list[str]]:
    """Section 5: zero-shot multiple choice (and the sweep of --zeroshot-ratios): (markdown, claims)."""
    p, args, lm, out = run.p, run.args, run.lm, run.out
    depth, shallow, window = run.depth, run.shallow, run.window
    md, claims = [], []
    pols = driver.resolve_policies("full,streaming,mat,snapkv", budget=args.budget, shallow_layers=shallow,
                                   num_layers=depth, **window)
    zs = driver.call(p, zeroshot.suite, lm, pols, out / "zeroshot", facts=args.zeroshot_facts,
                     flag_names={"facts": "zeroshot_facts"})
    res = zs.summary["results"]
    md += ["## 5. Zero-shot multiple choice, policy on the context", "", zs.table, ""]
    if args.zeroshot_ratios:
        from kvjax.experiments.zeroshot import builtin_task

        sweep = {"full": pols["full"]}
        # MAT's beta is a count, one per policy: a quarter of the kept share of the median context
        ctx = sorted(len(lm.tokenizer(row["context"])["input_ids"])
                     for row in builtin_task(40, 0, args.zeroshot_facts))
        for r in args.zeroshot_ratios:
            room = max(1, int((1 - r) * ctx[len(ctx) // 2]) // 4)
            for name, pol in driver.resolve_policies("streaming,mat,snapkv", ratio=r, num_layers=depth,
                                                     shallow_layers=shallow, anchor_slots=room).items():
                sweep[f"{name}@{r:g}"] = pol
        sw = driver.call(p, zeroshot.suite, lm, sweep, out / "zeroshot-sweep", facts=args.zeroshot_facts,
                         flag_names={"facts": "zeroshot_facts"})
        md += ["MAT Table 2's sweep: each policy removes a share r of each context (KV % = 100 (1 - r)); "
               "MAT's beta is a quarter of the kept share of the median context, one value per ratio (the paper "
               "grid-searches beta per budget; this sweep does not).", "", sw.table, "",
               "![accuracy vs KV](zeroshot-sweep/accuracy_vs_kv.png)", ""]
        sres = sw.summary["results"]
        # each ratio by the rule (unpaired binomial: the summary keeps accuracies, not items), the sweep by all_of
        at = {r: _binomial(sres[f"mat@{r:g}"]["acc"], sres[f"streaming@{r:g}"]["acc"], sres[f"mat@{r:g}"]["items"])
              for r in args.zeroshot_ratios}
        claims.append(f"MAT's accuracy >= StreamingLLM's at every KV share of the sweep: "
                      f"**{all_of([v for v, _ in at.values()])}** (at "
                      + ", ".join(f"r={r:g}: {sres[f'mat@{r:g}']['acc']:.3f} vs {sres[f'streaming@{r:g}']['acc']:.3f}"
                                  f" ({at[r][1]})" for r in args.zeroshot_ratios)
                      + f"; full {sres['full']['acc']:.3f}, chance {sw.summary['chance']:.3f}"
                      + _evidence(sres["full"]["acc"], sw.summary["chance"], "chance", sres["full"]["items"]))
    said, how = _binomial(res["mat"]["acc"], res["streaming"]["acc"], res["mat"]["items"])
    claims.append(f"MAT's accuracy >= StreamingLLM's on the zero-shot task: **{said}** "
                  f"(acc {({k: round(v['acc'], 3) for k, v in res.items()})}, chance {zs.summary['chance']:.3f}; "
                  f"{how}"
                  + (_evidence(res["full"]["acc"], zs.summary["chance"], "chance", res["full"]["items"])
                     if _evicted(res) else f"; no policy evicted anything: every context fits the budget of "
                                     f"{args.budget}, so this is no evidence either way)"))
    return md, claims


def _full_streaming_mat(run: Run) -> dict:
    """The full cache, StreamingLLM and MAT at the report's budget (sections 6 and 7)."""
    return driver.resolve_policies("full,streaming,mat", budget=run.args.budget, shallow_layers=run.shallow,
                                   num_layers=run.depth)


def passkey_section(run: Run) -> tuple[list[str], list[str]]:
    """Section 6: passkey retrieval: (markdown, claims)."""
    md, claims = [], []
    res = driver.call(run.p, passkey.suite, run.lm, _full_streaming_mat(run), run.out / "passkey")
    md += ["## 6. Passkey retrieval (accuracy %)", "", res.table, ""]
    return md, claims


def efficiency_section(run: Run) -> tuple[list[str], list[str]]:
    """Section 7: efficiency: (markdown, claims)."""
    md, claims = [], []
    res = driver.call(run.p, efficiency.suite, run.lm, _full_streaming_mat(run), run.out / "efficiency")
    md += ["## 7. Efficiency (MAT Table 6)", "", res.table, "",
           "![efficiency](efficiency/efficiency.png)", ""]
    return md, claims


def quantization_section(run: Run) -> tuple[list[str], list[str]]:
    """Section 8: a quantized cache (KIVI), alone and under eviction: (markdown, claims)."""
    p, args, lm, out = run.p, run.args, run.lm, run.out
    cfg, window, ppl_lengths = run.cfg, run.window, run.ppl_lengths
    md, claims = [], []
    from kvjax.policies import Quantized

    d = out / "quantization"
    group = 32 if cfg.head_dim % 32 == 0 else cfg.head_dim
    widths = {16: None, 8: dict(bits=8), 4: dict(bits=4, group=group, residual=128),
              2: dict(bits=2, group=group, residual=128)}

    def at_widths(base):  # labelled `full`, `full (8-bit KV)`, ... as every suite labels a quantized cache
        return driver.labelled({f"{lab}@{w}": pol if q is None else Quantized(pol, **q)
                                for lab, pol in base.items() for w, q in widths.items()})

    length = args.quant_ppl_length or min(ppl_lengths)
    ppl = driver.call(p, perplexity.suite, lm, at_widths(
        driver.resolve_policies("full") | driver.resolve_policies("streaming", budget=args.budget)),
        d / "perplexity", lengths=[length], text=args.ppl_text, sequences=args.ppl_sequences)
    keys = driver.call(p, passkey.suite, lm, at_widths(
        driver.resolve_policies("full") | driver.resolve_policies("snapkv", budget=args.budget, **window)),
        d / "passkey", lengths=args.razor_lengths, samples=args.razor_samples)
    md += ["## 8. A quantized cache (KIVI), alone and under eviction", "",
           f"16: the model's dtype; 8: int8 per token; 4 and 2: KIVI (keys per channel, values per token, group "
           f"{group}, the 128 most recent tokens in full precision, fewer where that would make the cache larger than "
           f"16-bit). StreamingLLM and SnapKV at budget "
           f"{args.budget}. Perplexity, the text read token by token, each token attending the stored cache ({args.ppl_sequences} "
           f"sequence(s) of {length} tokens):",
           "", ppl.table, "", "Passkey accuracy %: the prompt is attended in full precision and then stored, as KIVI "
           "prefills, so the width acts on the answer's tokens:", "", keys.table, ""]
    full_ppl = ppl.summary["ppl"]
    two, sixteen = full_ppl["full@2 (2-bit KV)"][str(length)], full_ppl["full@16"][str(length)]
    if two is None or sixteen is None:  # a length past the window at absolute positions is not run
        claims.append(f"KIVI 2-bit (R = 128) keeps perplexity within 5 % of full precision: **not run** ({length} "
                      "tokens is past the model's window)")
    else:
        # the margin left under the claimed 5 %, in log-perplexity, paired over the sequences
        gaps = _log_ppl_gaps(ppl.summary.get("nll_per_sequence", {}), "full@16", "full@2 (2-bit KV)", str(length))
        diff = math.log(1.05) + (float(np.mean(gaps)) if gaps else math.log(sixteen / two))
        se = paired_se(gaps)
        claims.append(f"KIVI 2-bit (R = 128) keeps perplexity within 5 % of full precision: "
                      f"**{verdict(diff, se)}** ({two:.2f} vs {sixteen:.2f} over {length} tokens; log(1.05) minus "
                      "the log-perplexity gap, "
                      + evidence(diff, se, paired=True, n=max(len(gaps), 1), of="sequences") + ")")
    return md, claims


def trained_section(run: Run, name: str, path: str | None, how: str) -> tuple[list[str], list[str]]:
    """The AnLLM or Attention-Gate section: the results of the trained variant in `path` (`how` it is made),
    read from the directory the user gave: (markdown, claims)."""
    args = run.args
    md, claims = [], []
    md += [f"## {name}", ""]
    if path:
        md += [(Path(path) / "results.md").read_text(), ""]
        r = _json(Path(path) / "results.json")
        if name == "AnLLM":  # Table 1: anchors keep the accuracy while the cache shrinks by C_down
            # the margin left inside 0.05, paired over the items where their scores are in the directory
            gaps = _anllm_gaps(Path(path) / "items.jsonl")
            diff = r["acc_ansan"] - r["acc_full"] + 0.05
            se = paired_se(gaps) if gaps else binomial_se(r["acc_ansan"], r["acc_full"], r["items"])
            claims.append(f"AnLLM with anchor caching (AnSAN), the demonstrations' cache cut by {r['C_down']:.0%}, "
                          f"accuracy {r['acc_ansan']:.3f} against full attention's {r['acc_full']:.3f} (chance "
                          f"{r['chance']:.3f}): " + report_page.anllm_table1_claim(
                              r, diff, se, len(gaps) if gaps else None, args.anllm_training_share))
        else:  # Table 1: at the same eviction, the gates lose less than the training-free baselines
            c = r["continuation_nll"]
            best = min(("local", "streaming", "h2o"), key=c.get)
            diff = c[best] - c["gate"]  # positive: the gates lose less than the best baseline
            se = (r.get("gate_minus_baseline") or {}).get(best, {}).get("se")  # paired over the windows
            claims.append(f"Attention-Gate's continuation NLL <= the best baseline's at the same eviction "
                          f"({r['baseline_eviction']:.0%}): {trained(verdict(diff, se), args.gate_training_share)} "
                          f"(NLL {', '.join(f'{k} {v:.3f}' for k, v in c.items())}; the best baseline, {best}, "
                          f"minus the gates: "
                          + evidence(diff, se, paired=True, n=r["windows"], of="windows",
                                     training_share=args.gate_training_share, digits=4) + ")")
    else:
        md += [f"Not run: {name} needs a trained variant of the model ({how}); pass its output with "
               f"--{'anllm' if name == 'AnLLM' else 'gate'} DIR.", ""]
        claims.append(f"{name}'s claims: **not run** (no trained variant given)")

    return md, claims


SECTION_RUNS = {"perplexity": perplexity_section, "longbench": longbench_section, "ruler": ruler_section,
                "zeroshot": zeroshot_section, "passkey": passkey_section, "efficiency": efficiency_section,
                "quantization": quantization_section}  # razor_section takes the heads main reads




def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.report", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    small = SMALL_DIR if (SMALL_DIR / "model.safetensors").is_file() else DEFAULT_MODEL_DIR
    p.add_argument("--model", default=str(small), help=model_help("kvjax-small"))
    p.add_argument("--budget", type=positive_int, default=256,
                   help="cache slots per layer and KV head of every policy outside the sweeps")
    p.add_argument("--budgets", type=int_list, default=[128, 256, 512],
                   help="the budgets of the sweeps: MAT vs StreamingLLM perplexity, SlimKV vs SnapKV")
    p.add_argument("--shallow-layers", type=nonnegative_int,
                   help="MAT's L_s (default: the paper's 2 of 32 layers scaled to the model, at least 1, so that "
                        "a shallow model still has deep layers)")
    p.add_argument("--samples", type=positive_int, default=20, help="LongBench-format samples per dataset")
    p.add_argument("--ppl-lengths", type=int_list,
                   help="section 1's text lengths (default: half the window, the window, twice it)")
    p.add_argument("--ppl-text", action="append",
                   help="section 1's text file (repeatable; default: the held-out standard-library text)")
    p.add_argument("--ppl-sequences", type=positive_int, default=1,
                   help="sections 1's and 8's (quantization's) sequences per length (MAT Table 3 averages many): "
                        "the claims' standard errors are over them, and one sequence has none")
    p.add_argument("--ppl-anchor-grid", type=perplexity.anchor_grid_arg,
                   help="section 1: MAT's beta grid-searched per length as --ppl-anchor-tuning says ('auto': the "
                        "paper's grid, 1 and budget/8 .. budget/2), as the paper tunes it")
    p.add_argument("--ppl-anchor-tuning", choices=perplexity.TUNINGS, default="next-window",
                   help="section 1: how --ppl-anchor-grid picks beta: on a window after the scored ones, or per "
                        "scored sequence on the others (leave-one-out; needs --ppl-sequences >= 2)")
    p.add_argument("--razor-lengths", type=int_list, help="section 2's prompt lengths (default: passkey's)")
    p.add_argument("--razor-samples", type=positive_int, default=PASSKEY_SAMPLES,
                   help="section 2's prompts per length and key depth")
    p.add_argument("--longbench-budgets", type=int_list, help="section 3's budgets (default: --budgets)")
    p.add_argument("--longbench-data", help="section 3's LongBench-format data directory (default: kvjax's "
                                            "suite for the model's window)")
    p.add_argument("--ruler-length", type=positive_int, help="section 4's sequence length (default: 4096, or the "
                                                              "model's window if shorter)")
    p.add_argument("--ruler-tasks", default="niah_single_1,niah_multikey_2,vt", help="section 4's RULER tasks")
    p.add_argument("--ruler-samples", type=positive_int, default=10, help="section 4's samples per task")
    p.add_argument("--ruler-batch", type=positive_int, default=4,
                   help="section 4's prompts per call (memory: a batch of 4 4K prompts under 23 policies held 16 GB "
                        "on SmolLM2; part of the section's identity)")
    p.add_argument("--ruler-ratios", type=float_list, default=list(RULER_RATIOS),
                   help="section 4's compression ratios (share of each prompt removed; default: "
                        f"{','.join(f'{r:g}' for r in RULER_RATIOS)}, to 32:1)")
    p.add_argument("--ruler-methods", type=lambda t: [x for x in t.split(",") if x],
                   help="section 4's methods, each at every --ruler-ratios (default: "
                        f"{','.join(RULER_METHODS)}); kvzap takes --kvzap DIR and runs, at ratio r, the threshold that "
                        "evicted a share r of its surrogate's held-out pairs")
    p.add_argument("--kvzap", help="section 4's KVzap surrogate (python -m kvjax.experiments.train_kvzap)")
    add_chat_template_arg(p)  # section 4's prompt format (and KVzip's replay in it)
    p.add_argument("--zeroshot-ratios", type=float_list,
                   help="section 5 at each ratio as well (MAT Table 2's sweep of the KV share)")
    p.add_argument("--zeroshot-facts", type=positive_int, default=4,
                   help="section 5's built-in task: facts hidden per passage, 1 to 4 (1 for a model that cannot "
                        "bind four: SmolLM2-135M is at chance with 4)")
    p.add_argument("--quant-ppl-length", type=positive_int,
                   help="the quantization section's text length (default: the shortest --ppl-lengths)")
    p.add_argument("--anllm", help="an kvjax.experiments.eval_anllm output directory to include")
    p.add_argument("--gate", help="an kvjax.experiments.eval_gate output directory to include")
    for flag in ("anllm", "gate"):  # the report cannot know the paper's corpus: the user says what share it was
        p.add_argument(f"--{flag}-training-share", type=_share,
                       help=f"the share of the paper's training tokens the --{flag} variant was trained on, in (0, 1]; "
                            "its verdict states it")
    p.add_argument("--skip", default="", help=f"comma-separated sections to leave out: {','.join(SECTIONS)}")
    p.add_argument("--out", default="results/report",
                   help="where the report goes (a folder; each section's results in OUT/<section>; a rerun resumes)")
    cli.add_compile_cache_flag(p)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    if skip - set(SECTIONS):
        p.error(f"--skip {args.skip}: {','.join(sorted(skip - set(SECTIONS)))} is not a section "
                f"(the sections: {','.join(SECTIONS)})")
    if not 1 <= args.zeroshot_facts <= 4:  # checked before hours of other sections, as the directories below
        p.error(f"--zeroshot-facts {args.zeroshot_facts}: the built-in task hides 1 to 4 facts")
    for flag, d in (("--anllm", args.anllm), ("--gate", args.gate)):  # checked before hours of other sections
        for name in ("results.md", "results.json"):
            if d and not (Path(d) / name).is_file():
                p.error(f"{flag} {d}: no {name} there (the output directory of kvjax.experiments.eval_"
                        f"{flag.removeprefix('--')})")
    if args.kvzap is not None and ("ruler" in skip or "kvzap" not in (args.ruler_methods or RULER_METHODS)):
        p.error(f"--kvzap {args.kvzap} is section 4's KVzap surrogate, but "
                + ("--skip leaves out section 4" if "ruler" in skip else "--ruler-methods does not name kvzap"))
    lm = driver.load_model(args.model)  # once: every section runs on these weights
    # OUT is this run's (a lock; a directory of the user's own files is refused) and this model's; each section
    # claims its own folder with its options
    driver.call(p, driver.claim, out, lm, {})
    cfg = lm.config
    n, depth = cfg.max_position_embeddings, cfg.num_layers
    # mat()'s default L_s = 2 would make every layer of a 2-layer model shallow, i.e. MAT = StreamingLLM
    shallow = args.shallow_layers if args.shallow_layers is not None else default_shallow_layers(cfg.num_layers)
    # SnapKV's observation window of 32 is a sixteenth of a 512-token window
    window = {"observation_window": 16} if n < 2048 else {}
    md = [f"# kvjax report: {shown(args.model)}", "", f"Budgets are cache slots per layer and KV head: {args.budget} outside "
          f"the sweeps, {', '.join(map(str, args.budgets))} in them (the model's window is {n} tokens); MAT's L_s = "
          f"{shallow} of {cfg.num_layers} layers. Command: `python -m kvjax.experiments.report "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}`.", ""]
    claims = []

    for r in (*args.ruler_ratios, *(args.zeroshot_ratios or ())):
        if not 0 <= r < 1:
            p.error(f"ratio {r}: a share of the prompt removed must be in [0, 1)")
    run = Run(p, args, lm, out, cfg, n, depth, shallow, window, args.ppl_lengths or [n // 2, n, 2 * n])
    for name in SECTIONS:
        if name in skip:
            continue
        if name == "razor":  # the one file the report reads back: the retrieval heads (the model's, or found here)
            heads = Path(args.model) / "heads.json"
            if not heads.is_file():
                heads = out / "heads.json"
                if not heads.is_file():
                    driver.call(p, find_heads.find, lm, heads, k=max(16, (n - 1) // 4), repeats=4, progress=True)
            part = razor_section(run, heads, np.asarray(_json(heads)["retrieval_kv_heads"], bool))
        else:
            part = SECTION_RUNS[name](run)
        md, claims = md + part[0], claims + part[1]
        engine.release_programs_near_map_limit()  # each section compiles its own programs (kvjax.engine says why)

    for name, path, how in (("AnLLM", args.anllm, "kvjax.experiments.train_anllm (EP continual pre-training) then "
                                                    "kvjax.experiments.eval_anllm"),
                            ("Attention-Gate", args.gate, "kvjax.experiments.train_gate (CPT) then kvjax.experiments.eval_gate "
                                                          "(baselines at the gates' own eviction ratio)")):
        part = trained_section(run, name, path, how)
        md, claims = md + part[0], claims + part[1]

    md += ["## Which claims hold in miniature", ""] + [f"- {c}" for c in claims] + [
        "", f"A {cfg.num_layers}-layer model with a {n}-token window is a miniature: a claim that fails here may "
        "hold on 7B models, and one that holds here is evidence about mechanism, not about scale."]
    write_atomic(out / "report.md", "\n".join(md) + "\n")
    print("\n".join(f"- {c}" for c in claims))
    print(f"wrote {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
