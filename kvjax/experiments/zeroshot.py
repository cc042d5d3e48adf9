"""Zero-shot multiple choice, lm-evaluation-harness style, under a cache policy.

    python -m kvjax.experiments.zeroshot [--model DIR] [--data items.jsonl] [--compare full,streaming,mat]
    python -m kvjax.experiments.zeroshot --scoring stream --compare full,streaming,mat --anchor-slots 8 \
        --ratios 0.8,0.7,0.5,0.3,0       # MAT Table 2 / Fig. 4: accuracy at 20 .. 100 % KV

An item is a context (a passage; may be empty), a query and choices; a choice's score is the sum of
its tokens' log-probs. `--scoring prefix` (default): the context is prefilled under the policy and
each choice extends the compressed cache (`kvjax.fewshot`: one parallel extension per item).
`--scoring stream`: each choice's whole sequence (BOS, context, query, choice) is read token by token
under the policy, the choice included, the choices of an item in one batch: MAT's protocol (lm-eval
with the budget applied at every token), where a ratio budget is a share of each sequence.
`--ratios` runs every policy at each fraction removed (`name@r`); KV % asked = 100 (1 - r), and the table and plot
give the share of the full cache each policy held, measured (RazorAttention's retrieval heads keep everything).
`acc`: the highest sum is the gold choice; `acc_norm`: the sum divided by the choice's length in
characters (lm-eval's definition). `--data` reads JSON lines {"context", "query", "choices", "gold"};
without it, a built-in task needing no download: made-up facts hidden in held-out reference text,
one asked, four values as choices (`--facts 4`, the default: the four hidden facts' values; `--facts 1`:
one fact, and three values the passage does not hold). Scores per item go to OUT/items.jsonl (resumable);
OUT/results.{md,json} hold acc / acc_norm per policy, and with --ratios OUT/accuracy_vs_kv.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from kvjax.experiments import cli, driver
from kvjax.experiments.common import (
    add_compare_args,
    add_run_args,
    compared,
    model_help,
    nonnegative_int,
    parse_ratios,
    positive_int,
    refuse_trained_text,
    suite_model,
)
from kvjax import cache as kvcache
from kvjax import fewshot, scoring
from kvjax.errors import InvalidInput, MissingFile
from kvjax.fewshot import Item
from kvjax.cli import HelpFormatter

FIELDS = ("context", "query", "choices", "gold")


def builtin_task(n: int = 40, seed: int = 0, facts: int = 4) -> list[dict]:
    """`facts` made-up facts (1 to 4) in held-out reference text; the question asks one; the choices are four
    values: the hidden facts' and, with fewer than 4 facts, made-up values found nowhere in the text.

    With 4 facts the model must bind the asked subject to its value (associative recall, which
    SmolLM2-135M does at chance); with 1 it must find the one value the passage holds, as a passkey
    task does, so the full cache scores far above chance and a cache that lost the fact cannot."""
    from kvjax.experiments.longbench.suite import _doc_sentences, _window
    from kvjax.experiments.tasks import ATTRIBUTES, fact_question, fact_sentence, made_up_name

    if not 1 <= facts <= 4:
        raise driver.ArgumentError(f"facts={facts}: the built-in task hides 1 to 4 facts")
    rng = np.random.default_rng(seed)
    sentences, items = _doc_sentences(), []
    attr = ATTRIBUTES[0]
    for _ in range(n):
        text = _window(rng, sentences, 700)
        hidden = [(made_up_name(rng), made_up_name(rng)) for _ in range(facts)]
        for subj, value in hidden:
            text.insert(int(rng.integers(0, len(text) + 1)), fact_sentence(attr, subj, value).strip())
        asked = int(rng.integers(facts))
        values = [v for _, v in hidden]
        if facts < 4:  # the absent values, then an order in which the asked value's place is random
            while len(values) < 4:  # a value the passage holds nowhere, not even by chance
                value = made_up_name(rng)
                if value not in values and value not in " ".join(text):
                    values.append(value)
            order = rng.permutation(4)
            values, gold = [values[i] for i in order], int(np.argmax(order == asked))
        else:  # the order the 4-fact task always had (its items stay the same)
            gold = asked
        items.append({"context": " ".join(text), "query": fact_question(attr, hidden[asked][0]),
                      "choices": [" " + v for v in values], "gold": gold})
    return items


def read_items(path: str) -> list[dict]:
    """The items of a JSON-lines file; a bad file, line or field is an `InvalidInput` naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MissingFile(f"--data {path} does not exist") from None
    except (UnicodeDecodeError, IsADirectoryError) as err:
        raise InvalidInput(f"{path} is not a UTF-8 text file ({err})") from None
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise InvalidInput(f"{path}:{n}: not valid JSON ({err})") from None
        if not isinstance(row, dict):
            raise InvalidInput(f"{path}:{n}: an item is a JSON object, got {type(row).__name__}")
        missing = [f for f in FIELDS if f not in row]
        if missing:
            raise InvalidInput(f"{path}:{n}: item is missing field {missing[0]!r} (an item has {list(FIELDS)})")
        gold, choices = row["gold"], row["choices"]
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices) or len(choices) < 2:
            raise InvalidInput(f"{path}:{n}: choices must be a list of at least 2 strings")
        if isinstance(gold, bool) or not isinstance(gold, int):  # 1.7 was once read as 1
            raise InvalidInput(f"{path}:{n}: gold={gold!r} must be an integer index into the choices")
        if not 0 <= gold < len(choices):
            raise InvalidInput(f"{path}:{n}: gold={gold} is not an index into {len(choices)} choices")
        if not isinstance(row["context"], str) or not isinstance(row["query"], str):
            raise InvalidInput(f"{path}:{n}: context and query must be strings")
        items.append(row)
    if not items:
        raise InvalidInput(f"{path} has no items")
    return items


SCORINGS = ("prefix", "stream")


def score_item(model, tok, row: dict, policy, how: str = "prefix") -> dict:
    """Option log-prob sums and the acc / acc_norm verdicts of one item (`how`: `--scoring`)."""
    # BOS + passage (just BOS for an empty context), whether or not the tokenizer adds BOS itself
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    context = bos + tok(row["context"], add_special_tokens=False)["input_ids"]
    if not context:
        raise InvalidInput("an item with an empty context needs a tokenizer with a BOS token")
    item = Item(tuple(tok(row["query"], add_special_tokens=False)["input_ids"]),
                tuple(tuple(tok(c, add_special_tokens=False)["input_ids"]) for c in row["choices"]), int(row["gold"]))
    share = None
    if how == "prefix":
        cache = fewshot.prefix_cache(model, context, policy, fewshot.room_for([item]))
        lp = fewshot.cached_scores(model, cache, len(context), item, policy)
        share = held_share(cache, len(context))
    else:  # every token of each whole sequence read under the policy; a choice's log-probs are its last
        rows = [context + list(item.query) + list(c) for c in item.options]
        lp = np.asarray([float(x[len(x) - len(c):].sum()) for x, c in
                         zip(scoring.logprobs_rows(model, rows, policy), item.options)])
    norm = lp / np.asarray([len(c) for c in row["choices"]])
    return {"logprobs": lp.tolist(), "acc": bool(np.argmax(lp) == item.answer),
            "acc_norm": bool(np.argmax(norm) == item.answer), "kv_share": share}


def held_share(cache, n: int) -> float:
    """The share of a full cache's slots (every layer, KV head and context token) that the compressed context's
    cache holds: what a policy really keeps (RazorAttention's retrieval heads keep every token, so it holds more
    than its local heads' ratio says). Every slot has the same fields, so it is the share of the bytes too."""
    held = sum(int(np.sum(p >= 0)) for p in kvcache.kept_positions(cache))
    heads = sum(p.shape[1] for p in kvcache.kept_positions(cache))
    return held / (heads * n)


def plot_vs_kv(path: Path, summary: dict) -> None:
    """MAT Fig. 4's axes: accuracy against the share of the full cache each policy held (measured; the nominal
    100 (1 - ratio) % where a record has no measure), a line per policy, the policies without a ratio as
    horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    swept = {}
    for lab, s in summary.items():
        if "@" in lab:
            name, r = lab.rsplit("@", 1)
            x = 100 * (1 - float(r)) if s.get("kv_share") is None else 100 * s["kv_share"]
            swept.setdefault(name, []).append((x, 100 * s["acc"]))
        else:
            ax.axhline(100 * s["acc"], ls="--", lw=0.8, color="k", label=lab)
    for name, pts in swept.items():
        ax.plot(*zip(*sorted(pts)), marker="o", label=name)
    ax.set(xlabel="KV cache held (% of the full cache's slots, measured)", ylabel="acc (%)", ylim=(-2, 102))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


BUILTIN = {"items": 40, "seed": 0, "facts": 4}  # the built-in task's defaults


def suite(lm, policies, out, *, data: str | None = None, items: int | None = None, seed: int | None = None,
          facts: int | None = None, scoring: str = "prefix", progress: bool = True) -> driver.SuiteResult:
    """Zero-shot multiple-choice accuracy of each policy (`{label: policy}`, a list or one) on `data`
    (JSON lines) or the built-in task of `items` items hiding `facts` facts each (defaults `BUILTIN`;
    refused with `data`), into `out`; summary `{"task", "scoring", "results": {label: {"acc", "acc_norm",
    ...}}}`. Labels `name@r` (from `--ratios`) are also plotted against the KV budget."""
    if scoring not in SCORINGS:
        raise driver.ArgumentError(f"scoring={scoring!r} is not one of {list(SCORINGS)}")
    task_options = driver.builtin_task(data, BUILTIN, items=items, seed=seed, facts=facts)
    items, seed, facts = task_options["items"], task_options["seed"], task_options["facts"]
    rows = read_items(data) if data else builtin_task(items, seed, facts)
    task = data or f"builtin(items={items}, seed={seed}" + (f", facts={facts})" if facts != 4 else ")")
    policies = driver.labelled(policies)
    # records are keyed by policy, so the policies (and --ratios) may grow across reruns
    rid = lambda cell: f"{task}|{policies[cell[0]].describe()}|{cell[1]}"  # noqa: E731  (label, item)

    def run(cell: list) -> list[dict]:
        (lab, i), = cell
        pol = policies[lab]
        return [{"id": rid((lab, i)), "policy": pol.describe(), **score_item(lm.model, lm.tokenizer, rows[i], pol,
                                                                              scoring)}]

    def report(log):
        summary = {}
        for lab, pol in policies.items():
            recs = [log.records[rid((lab, i))] for i in range(len(rows))]
            shares = [r.get("kv_share") for r in recs]
            summary[lab] = {"policy": pol.describe(), "acc": float(np.mean([r["acc"] for r in recs])),
                            "acc_norm": float(np.mean([r["acc_norm"] for r in recs])), "items": len(recs),
                            "kv_share": None if None in shares else float(np.mean(shares))}
        return write_report(Path(out), summary, task, rows, scoring)

    cells = [(lab, i) for lab in policies for i in range(len(rows))]
    return driver.run_suite(driver.Suite("zeroshot", "items.jsonl", cells, rid, run, report), out, lm,
                            {"data": data, "items": items, "seed": seed, "facts": facts, "scoring": scoring},
                            policies, progress=progress, files=("data",))


def write_report(out: Path, summary: dict, task: str, rows: list[dict], scoring: str
                 ) -> tuple[str, dict, list[Path]]:
    """(markdown, JSON summary, figures) of the accuracies `summary` (per label); draws OUT/accuracy_vs_kv.png
    when a label is `name@r`."""
    chance = float(np.mean([1 / len(r["choices"]) for r in rows]))
    lines = [f"Zero-shot multiple choice: {task} ({len(rows)} items, chance {100 * chance:.0f} %), {scoring} scoring",
             "",
             "| policy | KV % asked | KV % held | acc | acc_norm |", "|---|---|---|---|---|"]
    kv = lambda lab: f"{100 * (1 - float(lab.rsplit('@', 1)[1])):g}" if "@" in lab else ""  # noqa: E731
    held = lambda s: "" if s["kv_share"] is None else f"{100 * s['kv_share']:.1f}"  # noqa: E731
    lines += [f"| {lab} | {kv(lab)} | {held(s)} | {100 * s['acc']:.1f} | {100 * s['acc_norm']:.1f} |"
              for lab, s in summary.items()]
    lines += ["", "KV % asked: 100 (1 - ratio); held: the share of the full cache's slots the compressed context "
                  "holds, averaged over items (prefix scoring; the plot uses it)."]
    figures = []
    if any("@" in lab for lab in summary):
        figures.append(out / "accuracy_vs_kv.png")
        plot_vs_kv(figures[-1], summary)
    return "\n".join(lines), {"task": task, "scoring": scoring, "chance": chance, "results": summary}, figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.zeroshot", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", help=model_help("the embedded default model"))
    p.add_argument("--data", help="JSON lines of {context, query, choices, gold} (default: the built-in task)")
    p.add_argument("--items", type=positive_int, help=f"built-in task: number of items (default {BUILTIN['items']})")
    p.add_argument("--seed", type=nonnegative_int, help=f"built-in task: its seed (default {BUILTIN['seed']})")
    p.add_argument("--facts", type=positive_int,
                   help="built-in task: facts hidden per passage, 1 to 4 (default 4; fewer: the other choices are "
                        "values found nowhere in the passage; 1 is a passkey-like task, 4 associative recall)")
    p.add_argument("--scoring", choices=SCORINGS, default="prefix",
                   help="prefix: compress the context, then extend it with each choice; stream: read each whole "
                        "sequence, choice included, token by token under the policy (MAT's protocol)")
    p.add_argument("--ratios", help="comma-separated fractions removed: every policy with a ratio mode at each "
                                    "(MAT Fig. 4's KV budgets are 1 - ratio)")
    p.add_argument("--out", default="results/zeroshot",
                   help="where the results go (a folder; a rerun with the same options resumes there)")
    add_compare_args(p, default="full,streaming")
    add_run_args(p)
    args = p.parse_args(argv)
    parse_ratios(p, args)

    lm = suite_model(args)
    # the built-in task's passages are the default text's held-out topics (Attention-Gate's Table 1 protocol)
    refuse_trained_text(args.gate_params, [args.data] if args.data else None)
    res = driver.call(p, suite, lm, compared(p, args, lm.config.num_layers, lm.path), args.out, data=args.data, items=args.items, seed=args.seed,
                      facts=args.facts, scoring=args.scoring)
    print(res.table)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
