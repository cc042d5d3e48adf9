"""LongBench (v1 and LongBench-E) under kvjax cache policies; by default (the main job), kvjax-small on
kvjax's offline stdlib suite sized for its 2048-token context, under eight policies at a budget of 256
(8x compression): full, StreamingLLM, SnapKV, PyramidKV, SlimKV, MAT, RazorAttention and H2O.

    python -m kvjax.experiments.longbench                                  # the main job
    python -m kvjax.experiments.longbench --model DIR --data-dir LongBench/data --datasets qasper,lcc \\
        --compare full,snapkv,slimkv --budget 1024
    python -m kvjax.experiments.longbench --e --data-dir LongBench/data   # LongBench-E length buckets

Predictions are appended per sample (rerun the same command to resume); OUT/result.json holds
every score, OUT/results.{md,csv,json,png} the table of datasets x policies.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvjax.experiments import cli, driver
from kvjax.experiments.common import (
    CHAT_TEMPLATE_MODES,
    add_compare_args,
    add_protocol_arg,
    add_run_args,
    chat_template_on,
    compared,
    model_help,
    positive_int,
    suite_model,
)
from kvjax.experiments.held import mean_held, shown_held
from kvjax.experiments.longbench import harness
from kvjax.experiments.longbench.suite import DATA_DIR, SMALL_DATA_DIR
from kvjax.experiments.records import content_fingerprint, dumps_finite, write_atomic, write_csv_atomic, shown
from kvjax.models import SMALL_DIR
from kvjax.cli import HelpFormatter

DEFAULT_COMPARE = "full,streaming,snapkv,pyramidkv,slimkv,mat,razor,h2o"
MAIN_BUDGET = 256  # 8x compression of kvjax-small's contexts (about 2000 tokens)


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.longbench", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", help=model_help("kvjax-small, kvjax/models/small"))
    p.add_argument("--data-dir", help="directory of LongBench jsonl files (default: kvjax's offline stdlib suite, "
                                      f"{SMALL_DATA_DIR.name}/ for a model of >= 2048 tokens, else {DATA_DIR.name}/)")
    p.add_argument("--datasets", help="comma-separated dataset names (default: every .jsonl in --data-dir)")
    p.add_argument("--e", action="store_true", help="LongBench-E: read <dataset>_e.jsonl, score per length bucket")
    p.add_argument("--samples", type=positive_int, help="first N samples of each dataset")
    p.add_argument("--max-length", type=positive_int,
                   help="prompt tokens after middle truncation (default: max_position_embeddings - max new tokens)")
    p.add_argument("--batch", type=positive_int, default=8, help="samples generated together")
    p.add_argument("--chat-template", choices=CHAT_TEMPLATE_MODES, default="auto",
                   help="the tokenizer's chat template around each prompt, as LongBench's pred.py (not for the "
                        "datasets it exempts): auto (where the tokenizer has one), on (required) or off (raw text)")
    p.add_argument("--no-chat", dest="chat_template", action="store_const", const="off",
                   help="the same as --chat-template off")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the weights' and the cache's dtype")
    p.add_argument("--attention-impl", default="xla", choices=["xla", "pallas"],
                   help="pallas: the kernels of kvjax.pallas (interpret mode on CPU: slow, for checking)")
    p.add_argument("--out", default="results/longbench",
                   help="where the results go (a folder; a rerun with the same options resumes there)")
    add_compare_args(p, default=DEFAULT_COMPARE, budget=MAIN_BUDGET)
    add_protocol_arg(p)
    add_run_args(p)
    return p, p.parse_args(argv)


def write_tables(out: Path, result: dict) -> tuple[str, dict, list[Path]]:
    """(markdown, JSON summary, figures) of the datasets x policies table and each policy's mean KV held
    (`result["kv_held"]`, a label missing or None shown blank); writes OUT/results.csv."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = list(result["policies"])
    datasets = list(result["datasets"])
    table = {d: {lab: result["scores"][lab][d]["score"] for lab in labels} for d in datasets}
    avg = {lab: round(float(np.mean([table[d][lab] for d in datasets])), 2) for lab in labels}
    header = "| dataset | metric | " + " | ".join(labels) + " |"
    lines = [f"LongBench-format results: {result['model']} ({result['data_dir']})", "",
             "Policies: " + "; ".join(f"**{lab}** = `{desc}`" for lab, desc in result["policies"].items()), "",
             header, "|---|---|" + "---|" * len(labels)]
    for d in datasets:
        metric = result["scores"][labels[0]][d]["metric"]
        lines.append(f"| {d} | {metric} | " + " | ".join(f"{table[d][lab]:.2f}" for lab in labels) + " |")
    lines.append("| **average** | | " + " | ".join(f"**{avg[lab]:.2f}**" for lab in labels) + " |")
    held = {lab: result.get("kv_held", {}).get(lab) for lab in labels}  # None: a prediction predates the field
    lines.append("| KV held (mean) | | " + " | ".join(shown_held(held[lab]) for lab in labels) + " |")
    lines += ["", ("KV held: the share of the full cache's KV bytes the compressed prompt really holds, mean over "
                   "every prediction of the policy; blank where a prediction predates the measurement.")]
    if result["e"]:
        lines += ["", "LongBench-E buckets:", "", "| dataset | policy | 0-4k | 4-8k | 8k+ |", "|---|---|---|---|---|"]
        for d in datasets:
            for lab in labels:
                b = result["scores"][lab][d]["buckets"]
                lines.append(f"| {d} | {lab} | " + " | ".join(str(b.get(k, "")) for k in ("0-4k", "4-8k", "8k+"))
                             + " |")
    write_csv_atomic(out / "results.csv", [["dataset", *labels]] + [[d, *(table[d][lab] for lab in labels)] for d in datasets]
                     + [["average", *(avg[lab] for lab in labels)]]
                     + [["kv_held", *("" if held[lab] is None else held[lab] for lab in labels)]])
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(datasets), 3.2))
    width = 0.8 / len(labels)
    for i, lab in enumerate(labels):
        ax.bar(np.arange(len(datasets)) + i * width, [table[d][lab] for d in datasets], width, label=lab)
    ax.set_xticks(np.arange(len(datasets)) + 0.4 - width / 2, [d.replace("stdlib_", "") for d in datasets],
                  rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("score")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=110)
    plt.close(fig)
    return "\n".join(lines), {"table": table, "average": avg, "kv_held": held}, [out / "results.png"]


def chosen_datasets(lm, data_dir: str | None, datasets: list[str] | None, e: bool) -> tuple[str, list[str]]:
    """(data directory, dataset names): the offline suite for the model's window unless given, every
    dataset in it unless named; an unknown name is an error."""
    if data_dir is None:
        data_dir = str(SMALL_DATA_DIR if lm.model.cfg.max_position_embeddings >= 2048 else DATA_DIR)
    names = list(datasets) if datasets else harness.dataset_names(Path(data_dir), e)
    for n in names:
        harness.check_dataset(n)
    return data_dir, names


def suite(lm, policies, out, *, data_dir: str | None = None, datasets: list[str] | None = None, e: bool = False,
          samples: int | None = None, max_length: int | None = None, batch: int = 8, chat: bool = True,
          protocol: str = "aware", progress: bool = True) -> driver.SuiteResult:
    """Every dataset of `data_dir` (default: kvjax's offline suite for the model's window) under each
    policy (`{label: policy}`, a list or one), into `out`: predictions per sample (resumable),
    OUT/result.json with every score; summary `{"table": {dataset: {label: score}}, "average": ..., "kv_held":
    {label: mean share of the full cache's KV bytes held, None if a prediction predates the field}}`.
    `e`: LongBench-E, scored per length bucket."""
    driver.positive(samples, "samples", optional=True)
    driver.positive(batch, "batch")
    data_dir, names = chosen_datasets(lm, data_dir, datasets, e)
    policies = driver.labelled(policies)
    out = Path(out)
    opts = harness.Options(max_length=max_length, batch=batch, samples=samples, chat=chat, e=e, protocol=protocol)
    t0 = time.time()

    def run(cell: list) -> list[dict]:  # the policies of a dataset run together; each keeps its own predictions
        d, = cell
        preds = harness.predict_many(lm, list(policies.values()), Path(data_dir), d, out, opts, progress)
        return [{"id": d, "scores": {label: harness.score_dataset(d, p, e) for label, p in zip(policies, preds)},
                 "preds": dict(zip(policies, preds))}]  # kept in memory only, for the mean KV held

    def report(log):
        scores = {label: {d: log.records[d]["scores"][label] for d in names} for label in policies}
        held = {label: mean_held([p for d in names for p in log.records[d]["preds"][label]]) for label in policies}
        result = {"model": shown(lm.path), "data_dir": shown(data_dir), "datasets": names, "e": e,
                  "policies": {lab: pol.describe() for lab, pol in policies.items()},
                  "slugs": {lab: harness.policy_slug(pol) for lab, pol in policies.items()},
                  "scores": scores, "kv_held": held, "seconds": round(time.time() - t0, 1)}
        write_atomic(out / "result.json", dumps_finite(result))
        return write_tables(out, result)

    # The templates, generation budgets and metrics (config.json) shape every prediction: records made under
    # another config are not this run's. Each policy's predictions are in their own directory (`log=None`).
    return driver.run_suite(driver.Suite("longbench", None, names, lambda d: d, run, report), out, lm,
                            {"data_dir": data_dir, "e": e, "max_length": max_length, "batch": batch, "chat": chat,
                             "protocol": protocol}, policies, progress=progress, files=("data_dir",),
                            extra={"--data-dir": str(Path(data_dir).resolve()),
                                   "harness config": content_fingerprint(harness.CONFIG_FILE)})


def main(argv: list[str] | None = None) -> int:
    p, args = parse(argv)
    args.model = args.model or (SMALL_DIR if (SMALL_DIR / "model.safetensors").is_file() else None)
    datasets = args.datasets.split(",") if args.datasets else None
    # a wrong dataset is reported before a wrong policy (and before --gate-params)
    lm = suite_model(args, dtype=args.dtype, attention_impl=args.attention_impl,
                     check=lambda lm: chosen_datasets(lm, args.data_dir, datasets, args.e))
    chat = lm.tokenizer is None or chat_template_on(lm.tokenizer, args.chat_template)  # "on" without one: refused
    chosen = (args.compare or args.policy or args.compare_default).split(",")
    if "razor" in chosen and args.buffer is None and args.compression is None:
        # RazorAttention's S0 = 4000 (the paper's, for 7B models at long contexts) would keep these whole
        # prompts: its local heads keep the budget instead (the description records it)
        args.buffer = args.budget or args.default_budget
    res = driver.call(p, suite, lm, compared(p, args, lm.config.num_layers, lm.path), args.out, data_dir=args.data_dir,
                      datasets=datasets, e=args.e, samples=args.samples,
                      max_length=args.max_length, batch=args.batch, chat=chat, protocol=args.protocol)
    print(res.table)
    print(f"wrote {res.out}/result.json and results.{{md,csv,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
