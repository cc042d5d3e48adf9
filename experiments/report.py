"""The papers' main tables in miniature on one model: runs the suites x policies and writes one report.

    python -m experiments.report [--model DIR] [--budget 128] [--out results/report]

Sections (each a suite run into OUT/<section>/, so an interrupted report resumes cell by cell):
1. MAT vs StreamingLLM perplexity at equal budget, in and beyond the trained window (MAT Table 3);
2. RazorAttention vs StreamingLLM vs H2O on needle in a haystack (RazorAttention Fig. / Table),
   with retrieval heads found by `experiments.find_heads` on the same model;
3. SlimKV vs SnapKV (and the baselines) on the LongBench-format suite (SlimKV Table 1);
4. zero-shot multiple choice with the policy applied to the context (MAT's lm-eval table);
5. passkey retrieval; 6. efficiency (MAT Table 6).
Then OUT/report.md: every table, the plots, and which claims hold in miniature, computed from the
numbers. AnLLM and Attention-Gate need trained variants of the model: pass `--anllm DIR` (from
`experiments.eval_anllm`) or `--gate DIR` (from `experiments.eval_gate`) to include their results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments import cli, efficiency, needle, passkey, perplexity, zeroshot
from experiments.common import DEFAULT_MODEL_DIR
from experiments.longbench import __main__ as longbench


def _run(main, argv: list[str]) -> None:
    code = main(argv)
    if code:
        raise RuntimeError(f"{main.__module__} {' '.join(argv)} exited with {code}")


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _verdict(holds: bool) -> str:
    return "**holds**" if holds else "**does not hold**"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="local HF directory (default: the default model)")
    p.add_argument("--budget", type=int, default=128, help="cache slots per layer and KV head for every policy")
    p.add_argument("--shallow-layers", type=int,
                   help="MAT's L_s (default: the paper's 2 of 32 layers scaled to the model, at least 1, so that "
                        "a shallow model still has deep layers)")
    p.add_argument("--samples", type=int, default=20, help="LongBench-format samples per dataset")
    p.add_argument("--anllm", help="an experiments.eval_anllm output directory to include")
    p.add_argument("--gate", help="an experiments.eval_gate output directory to include")
    p.add_argument("--skip", default="", help="comma-separated sections to leave out: "
                                              "perplexity,needle,longbench,zeroshot,passkey,efficiency")
    p.add_argument("--out", default="results/report")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    m, b = ["--model", args.model], ["--budget", str(args.budget)]
    from models.loading import read_config

    cfg = read_config(Path(args.model))[0]
    n = cfg.max_position_embeddings
    # mat()'s default L_s = 2 would make every layer of a 2-layer model shallow, i.e. MAT = StreamingLLM
    shallow = args.shallow_layers if args.shallow_layers is not None else max(1, round(2 * cfg.num_layers / 32))
    ls = ["--shallow-layers", str(shallow)]
    md = [f"# kvjax report: {args.model}", "", f"Every policy at a budget of {args.budget} slots per layer and KV "
          f"head (the model's window is {n} tokens); MAT's L_s = {shallow} of {cfg.num_layers} layers. Commands: `python -m experiments.report "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}`.", ""]
    claims = []

    if "perplexity" not in skip:
        d = out / "perplexity"
        lengths = f"{n // 2},{n},{2 * n}"
        _run(perplexity.main, m + b + ["--compare", "full", "--lengths", f"{n // 2},{n}", "--out", str(d / "full")])
        _run(perplexity.main, m + b + ["--compare", "streaming,mat", "--positions", "rolling", "--lengths", lengths,
                                       *ls, "--out", str(d / "rolling")])
        full, roll = _json(d / "full" / "results.json")["ppl"], _json(d / "rolling" / "results.json")["ppl"]
        md += ["## 1. Perplexity with a bounded cache (MAT Table 3)", "", "Full cache (absolute positions):", "",
               (d / "full" / "results.md").read_text(), "StreamingLLM and MAT (rolling positions):", "",
               (d / "rolling" / "results.md").read_text(), "![perplexity](perplexity/rolling/perplexity.png)", ""]
        mat_better = all(roll["mat"][k] <= roll["streaming"][k] for k in roll["mat"] if roll["mat"][k] is not None)
        claims.append(f"MAT's perplexity <= StreamingLLM's at equal budget at every length: {_verdict(mat_better)} "
                      f"(MAT {roll['mat']}, StreamingLLM {roll['streaming']}; full cache in window {full['full']})")

    if "needle" not in skip:
        d = out / "needle"
        heads = out / "heads.json"
        if not heads.is_file():
            from experiments import find_heads

            k = max(16, (n - 1) // 4)
            _run(find_heads.main, ["--model", args.model, "--out", str(heads), "--k", str(k), "--repeats", "4"])
        _run(needle.main, m + b + ["--compare", "full,streaming,h2o,razor", "--heads", str(heads),
                                   "--buffer", str(args.budget), "--out", str(d)])
        res = _json(d / "results.json")
        md += ["## 2. Needle in a haystack (RazorAttention)", "", (d / "results.md").read_text(), ""]
        md += [f"![{lab}](needle/heatmap_{lab}.png)" for lab in res] + [""]
        em = {lab: r["exact_match"] for lab, r in res.items()}
        claims.append("RazorAttention retrieves at least as well as StreamingLLM and H2O at equal budget: "
                      f"{_verdict(em['razor'] >= max(em['streaming'], em['h2o']))} (exact match {em})")

    if "longbench" not in skip:
        d = out / "longbench"
        _run(longbench.main, m + b + ["--compare", "full,streaming,h2o-prefill,snapkv,slimkv", "--samples",
                                      str(args.samples), "--window", "16", "--out", str(d)])
        avg = _json(d / "results.json")["average"]
        md += ["## 3. LongBench-format suite (SlimKV / SnapKV)", "", (d / "results.md").read_text(),
               "![longbench](longbench/results.png)", ""]
        claims.append(f"SlimKV >= SnapKV on average over the LongBench-format suite: "
                      f"{_verdict(avg['slimkv'] >= avg['snapkv'])} (averages {avg})")

    if "zeroshot" not in skip:
        d = out / "zeroshot"
        _run(zeroshot.main, m + b + ["--compare", "full,streaming,mat,snapkv", "--window", "16", *ls, "--out", str(d)])
        res = _json(d / "results.json")["results"]
        md += ["## 4. Zero-shot multiple choice, policy on the context", "", (d / "results.md").read_text(), ""]
        claims.append(f"MAT's accuracy >= StreamingLLM's on the zero-shot task: "
                      f"{_verdict(res['mat']['acc'] >= res['streaming']['acc'])} "
                      f"(acc {({k: round(v['acc'], 3) for k, v in res.items()})})")

    if "passkey" not in skip:
        d = out / "passkey"
        for pol in ("full", "streaming", "mat"):
            _run(passkey.main, m + b + ["--policy", pol, *(ls if pol == "mat" else []), "--out", str(d)])
        md += ["## 5. Passkey retrieval (accuracy %)", "", (d / "results.md").read_text(), ""]

    if "efficiency" not in skip:
        d = out / "efficiency"
        _run(efficiency.main, m + b + ["--compare", "full,streaming,mat", *ls, "--out", str(d)])
        md += ["## 6. Efficiency (MAT Table 6)", "", (d / "results.md").read_text(),
               "![efficiency](efficiency/efficiency.png)", ""]

    for name, path in (("AnLLM", args.anllm), ("Attention-Gate", args.gate)):
        if path:
            md += [f"## {name}", "", (Path(path) / "results.md").read_text(), ""]

    md += ["## Which claims hold in miniature", ""] + [f"- {c}" for c in claims] + [
        "", f"A {cfg.num_layers}-layer model with a {n}-token window is a miniature: a claim that fails here may "
        "hold on 7B models, and one that holds here is evidence about mechanism, not about scale."]
    (out / "report.md").write_text("\n".join(md) + "\n")
    print("\n".join(f"- {c}" for c in claims))
    print(f"wrote {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
