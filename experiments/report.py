"""The papers' main tables in miniature on one model: runs the suites x policies and writes one report.

    python -m experiments.report [--model DIR] [--budget 256] [--budgets 128,256,512] [--out results/report]

By default the model is kvjax-small (models/small; the 0.52 M default if it is missing). The model is
loaded once and each section calls its suite as a function (`experiments.driver`: typed options,
a `SuiteResult` back) into OUT/<section>/, so an interrupted report resumes cell by cell. Each
section states the protocol that makes its comparison fair:
1. MAT vs StreamingLLM perplexity at equal budget, at every budget of --budgets, in and beyond the
   trained window, both with rolling positions (MAT Table 3);
2. RazorAttention vs StreamingLLM vs H2O on passkey retrieval **at equal cache bytes** (RazorAttention's
   Table 1 task, which a small model does with its full cache, unlike the needle's free-text fact):
   Razor's local heads keep --budget tokens, and StreamingLLM and H2O get the token budget that holds
   as many slots as Razor's cache at the longest length (`kvjax.cache.equal_bytes_budget`), since
   Razor's retrieval heads keep the whole prompt; retrieval heads from the model's heads.json or
   `experiments.find_heads`;
3. SlimKV vs SnapKV (and the baselines) on the LongBench-format suite at every budget of --budgets
   (SlimKV Table 1);
4. zero-shot multiple choice with the policy applied to the context (MAT's lm-eval table);
5. passkey retrieval; 6. efficiency (MAT Table 6).
Then OUT/report.md: every table, the plots, and which claims hold in miniature, computed from the
numbers; a comparison where the full cache does no better than chance (or than the compressed
policies) is said to be no evidence either way. AnLLM and Attention-Gate need trained variants of the
model: pass `--anllm DIR` (from `experiments.eval_anllm`) or `--gate DIR` (from `experiments.eval_gate`)
to include their results; without them the report says they were not run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

import numpy as np

from experiments import cli, driver, efficiency, find_heads, passkey, perplexity, zeroshot
from experiments.common import DEFAULT_MODEL_DIR, int_list, positive_int
from experiments.longbench import __main__ as longbench
from models import SMALL_DIR


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _verdict(holds: bool) -> str:
    return "**holds**" if holds else "**does not hold**"


def _evidence(full: float, floor: float, floor_name: str, n: int) -> str:
    """The close of a claim's numbers: a comparison of caches says something only about a task the model
    does with its full cache, i.e. above `floor` (chance, or what the compressed caches score) by more
    than two binomial standard errors of n items (at p = floor, at least 1 / n: 0.14 at chance 0.25 with
    40 items), so a small suite's noise is not read as the model doing the task."""
    margin = 2 * max(math.sqrt(floor * (1 - floor) / n), 1 / n)
    return f"; the full cache is no better than {floor_name}, so this is no evidence either way)" \
        if full <= floor + margin else ")"


SECTIONS = ("perplexity", "razor", "longbench", "zeroshot", "passkey", "efficiency")
PASSKEY_SAMPLES = 5  # per prompt length and key depth, in section 2
RENAMED = {"needle": "razor"}  # section 2 ran on the needle before it ran on the passkey task


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n")[0])
    small = SMALL_DIR if (SMALL_DIR / "model.safetensors").is_file() else DEFAULT_MODEL_DIR
    p.add_argument("--model", default=str(small), help="local HF directory (default: kvjax-small)")
    p.add_argument("--budget", type=positive_int, default=256,
                   help="cache slots per layer and KV head of every policy outside the sweeps")
    p.add_argument("--budgets", type=int_list, default=[128, 256, 512],
                   help="the budgets of the sweeps: MAT vs StreamingLLM perplexity, SlimKV vs SnapKV")
    p.add_argument("--shallow-layers", type=int,
                   help="MAT's L_s (default: the paper's 2 of 32 layers scaled to the model, at least 1, so that "
                        "a shallow model still has deep layers)")
    p.add_argument("--samples", type=int, default=20, help="LongBench-format samples per dataset")
    p.add_argument("--anllm", help="an experiments.eval_anllm output directory to include")
    p.add_argument("--gate", help="an experiments.eval_gate output directory to include")
    p.add_argument("--skip", default="", help=f"comma-separated sections to leave out: {','.join(SECTIONS)}")
    p.add_argument("--out", default="results/report")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    for old in skip & set(RENAMED):
        warnings.warn(f"--skip {old} is now --skip {RENAMED[old]}", DeprecationWarning, stacklevel=2)
    skip = {RENAMED.get(s, s) for s in skip}
    if skip - set(SECTIONS):
        p.error(f"--skip {args.skip}: {','.join(sorted(skip - set(SECTIONS)))} is not a section "
                f"(the sections: {','.join(SECTIONS)})")
    lm = driver.load_model(args.model)  # once: every section runs on these weights
    cfg = lm.config
    n, depth = cfg.max_position_embeddings, cfg.num_layers
    # mat()'s default L_s = 2 would make every layer of a 2-layer model shallow, i.e. MAT = StreamingLLM
    shallow = args.shallow_layers if args.shallow_layers is not None else max(1, round(2 * cfg.num_layers / 32))
    # SnapKV's observation window of 32 is a sixteenth of a 512-token window
    window = {"observation_window": 16} if n < 2048 else {}
    md = [f"# kvjax report: {args.model}", "", f"Budgets are cache slots per layer and KV head: {args.budget} outside "
          f"the sweeps, {', '.join(map(str, args.budgets))} in them (the model's window is {n} tokens); MAT's L_s = "
          f"{shallow} of {cfg.num_layers} layers. Command: `python -m experiments.report "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}`.", ""]
    claims = []

    if "perplexity" not in skip:
        d = out / "perplexity"
        full = driver.call(p, perplexity.suite, lm, driver.resolve_policies("full"), d / "full", lengths=[n // 2, n])
        md += ["## 1. Perplexity with a bounded cache (MAT Table 3)", "", "Full cache (absolute positions):", "",
               full.table, ""]
        for budget in args.budgets:
            pols = driver.resolve_policies("streaming,mat", budget=budget, positions="rolling", shallow_layers=shallow,
                                           num_layers=depth)
            res = driver.call(p, perplexity.suite, lm, pols, d / f"rolling-{budget}", lengths=[n // 2, n, 2 * n])
            roll = res.summary["ppl"]
            md += [f"StreamingLLM and MAT at budget {budget} (rolling positions):", "", res.table, "",
                   f"![perplexity](perplexity/rolling-{budget}/perplexity.png)", ""]
            better = all(roll["mat"][k] <= roll["streaming"][k] for k in roll["mat"] if roll["mat"][k] is not None)
            claims.append(f"MAT's perplexity <= StreamingLLM's at budget {budget} at every length: {_verdict(better)} "
                          f"(MAT {roll['mat']}, StreamingLLM {roll['streaming']}; full cache in window "
                          f"{full.summary['ppl']['full']})")

    if "razor" not in skip:
        from kvjax.cache import equal_bytes_budget

        d = out / "razor"
        heads = Path(args.model) / "heads.json"
        if not heads.is_file():
            heads = out / "heads.json"
            if not heads.is_file():
                driver.call(p, find_heads.find, lm, heads, k=max(16, (n - 1) // 4), repeats=4, progress=True)
        longest = max(passkey.default_lengths(lm.tokenizer, n))
        razor = driver.resolve_policies("razor", heads=str(heads), buffer=args.budget)["razor"]
        same_bytes = equal_bytes_budget(lm.model, razor, longest, passkey.MAX_NEW_TOKENS)
        pols = driver.resolve_policies("full,streaming,h2o", budget=same_bytes) | {"razor": razor}
        res = driver.call(p, passkey.suite, lm, pols, d, samples=PASSKEY_SAMPLES)
        md += ["## 2. Passkey retrieval (RazorAttention Table 1) at equal cache bytes", "",
               f"RazorAttention's local heads keep {args.budget} tokens (+ 4 sinks and the compensation token) and "
               f"its retrieval heads the whole prompt; at the longest length ({longest} tokens) its cache holds as "
               f"many slots as a {same_bytes}-token budget per layer and KV head, the budget StreamingLLM and H2O "
               "get here. Accuracy % per prompt length and key depth:", "", res.table, "",
               "![passkey at equal bytes](razor/results.png)", ""]
        cells = {lab: [a for row in res.summary[pol.describe()].values() for a in row.values()]
                 for lab, pol in pols.items()}
        acc = {lab: round(float(np.mean(c)), 3) for lab, c in cells.items()}
        claims.append(f"RazorAttention retrieves at least as well as StreamingLLM and H2O at equal cache bytes "
                      f"(budget {same_bytes}): {_verdict(acc['razor'] >= max(acc['streaming'], acc['h2o']))} "
                      f"(passkey accuracy {acc}"
                      + _evidence(acc["full"], max(acc["streaming"], acc["h2o"]), "StreamingLLM's or H2O's",
                                  PASSKEY_SAMPLES * len(cells["full"])))

    if "longbench" not in skip:
        md += ["## 3. LongBench-format suite (SlimKV / SnapKV)", ""]
        for budget in args.budgets:
            d = out / "longbench" / f"budget-{budget}"
            pols = driver.resolve_policies("full,streaming,h2o-prefill,snapkv,slimkv", budget=budget, **window)
            res = driver.call(p, longbench.suite, lm, pols, d, samples=args.samples)
            avg = res.summary["average"]
            md += [f"Budget {budget}:", "", res.table, "", f"![longbench](longbench/budget-{budget}/results.png)", ""]
            claims.append(f"SlimKV >= SnapKV on average over the LongBench-format suite at budget {budget}: "
                          f"{_verdict(avg['slimkv'] >= avg['snapkv'])} (averages {avg})")

    if "zeroshot" not in skip:
        pols = driver.resolve_policies("full,streaming,mat,snapkv", budget=args.budget, shallow_layers=shallow,
                                       num_layers=depth, **window)
        zs = driver.call(p, zeroshot.suite, lm, pols, out / "zeroshot")
        res = zs.summary["results"]
        md += ["## 4. Zero-shot multiple choice, policy on the context", "", zs.table, ""]
        claims.append(f"MAT's accuracy >= StreamingLLM's on the zero-shot task: "
                      f"{_verdict(res['mat']['acc'] >= res['streaming']['acc'])} "
                      f"(acc {({k: round(v['acc'], 3) for k, v in res.items()})}, chance {zs.summary['chance']:.3f}"
                      + _evidence(res["full"]["acc"], zs.summary["chance"], "chance", res["full"]["items"]))

    if "passkey" not in skip:
        pols = driver.resolve_policies("full,streaming,mat", budget=args.budget, shallow_layers=shallow,
                                       num_layers=depth)
        md += ["## 5. Passkey retrieval (accuracy %)", "", driver.call(p, passkey.suite, lm, pols, out / "passkey").table, ""]

    if "efficiency" not in skip:
        pols = driver.resolve_policies("full,streaming,mat", budget=args.budget, shallow_layers=shallow,
                                       num_layers=depth)
        md += ["## 6. Efficiency (MAT Table 6)", "", driver.call(p, efficiency.suite, lm, pols, out / "efficiency").table, "",
               "![efficiency](efficiency/efficiency.png)", ""]

    for name, path, how in (("AnLLM", args.anllm, "experiments.train_anllm (EP continual pre-training) then "
                                                    "experiments.eval_anllm"),
                            ("Attention-Gate", args.gate, "experiments.train_gate (CPT) then experiments.eval_gate "
                                                          "(baselines at the gates' own eviction ratio)")):
        md += [f"## {name}", ""]
        if path:
            md += [(Path(path) / "results.md").read_text(), ""]
            r = _json(Path(path) / "results.json")
            if name == "AnLLM":  # Table 1: anchors keep the accuracy while the cache shrinks by C_down
                claims.append(f"AnLLM with anchor caching (AnSAN) keeps full attention's accuracy (within 0.05) "
                              f"while cutting the demonstrations' cache by {r['C_down']:.0%}: "
                              f"{_verdict(r['acc_ansan'] >= r['acc_full'] - 0.05)} (accuracy {r['acc_ansan']:.3f} "
                              f"vs {r['acc_full']:.3f}, chance {r['chance']:.3f}"
                              + _evidence(r["acc_full"], r["chance"], "chance", r["items"]))
            else:  # Table 1: at the same eviction, the gates lose less than the training-free baselines
                c = r["continuation_nll"]
                best = min(c[k] for k in ("local", "streaming", "h2o"))
                claims.append(f"Attention-Gate's continuation NLL <= the best baseline's at the same eviction "
                              f"({r['baseline_eviction']:.0%}): {_verdict(c['gate'] <= best)} "
                              f"(NLL {', '.join(f'{k} {v:.3f}' for k, v in c.items())})")
        else:
            md += [f"Not run: {name} needs a trained variant of the model ({how}); pass its output with "
                   f"--{'anllm' if name == 'AnLLM' else 'gate'} DIR.", ""]
            claims.append(f"{name}'s claims: **not run** (no trained variant given)")

    md += ["## Which claims hold in miniature", ""] + [f"- {c}" for c in claims] + [
        "", f"A {cfg.num_layers}-layer model with a {n}-token window is a miniature: a claim that fails here may "
        "hold on 7B models, and one that holds here is evidence about mechanism, not about scale."]
    (out / "report.md").write_text("\n".join(md) + "\n")
    print("\n".join(f"- {c}" for c in claims))
    print(f"wrote {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
