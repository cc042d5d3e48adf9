"""AnLLM's few-shot evaluation (its Table 1): accuracy with full attention and with anchor-based
inference (AnSAN), cache length L_kv, cache reduction C⇓ and acceleration T⇑.

    python -m kvjax.experiments.eval_anllm --model DIR --out DIR [--data items.jsonl] [--items 100]

The model directory is one written by `kvjax.experiments.train_anllm` (its config.json names
the anchors); `--anchor-tokens` overrides. Items come from `--data` (JSON lines with
`demos` (list of strings), `query`, `options` (strings) and `answer` (index); each item
is scored with its own demonstrations, and a line without `demos` takes the last ones
given above it), or from the built-in offline task:
`--shots` facts "The code of NAME is NUMBER." as demonstrations, a query "The code of
NAME is" for one of them and `--options` numbers as options: other facts' (`--distractors demos`,
associative recall) or ones no fact holds (`--distractors absent`); either way the demonstrations'
numbers are what the anchors must carry. AnLLM-AC models get `<AC>`
after every demonstration, as in the paper's five-shot setting; `--placement every:10` or
`random:0.1` puts them where AnLLM's Table 3 does instead, in the demonstrations of the
same model ("All the experiments are conducted with the AnLLM-AC model in Table 1"): the
table varies the demonstrations' anchors, not the training.

Per-item scores go to OUT/items.jsonl as they finish, so a rerun resumes; the summary
is written to OUT/results.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from kvjax.progress import Bar as progress_bar

from kvjax.experiments import cli, driver
from kvjax.experiments.common import add_run_args, model_help, nonnegative_int, positive_int
from kvjax.experiments.records import dumps_finite, write_atomic, shown
from kvjax.experiments.train_anllm import anchor_ids_of
from kvjax import fewshot
from kvjax.anllm_anchors import AC_TOKEN, place_anchors
from kvjax.errors import InvalidInput
from kvjax.fewshot import Item
from kvjax.policies import FullCache
from kvjax.policies.anllm import AnchorReduction
from kvjax.cli import HelpFormatter

NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "John", "Frances", "Ken", "Dennis", "Guido",
         "Niklaus", "Tony", "Leslie", "Margaret", "Robin", "Dana", "Michael", "Fran", "Butler"]


DISTRACTORS = ("demos", "absent")
BUILTIN = {"items": 100, "shots": 5, "options": 4, "distractors": "demos"}  # the built-in task's defaults


def fact_task(n_items: int, shots: int, options: int, seed: int, distractors: str = "demos"
              ) -> tuple[list[str], list[dict]]:
    """Demonstrations (facts) and items asking for one fact's number among `options` numbers: the numbers of
    other demonstrations (`distractors="demos"`: the model must bind the name to its number, associative
    recall), or numbers no demonstration holds (`"absent"`: it must find which option it has read, as a
    passkey task does; SmolLM2-135M's full attention is at chance on the first and not on the second)."""
    if distractors not in DISTRACTORS:
        raise InvalidInput(f"distractors={distractors!r} is not one of {list(DISTRACTORS)}")
    # other demonstrations' numbers as options need as many demonstrations; absent numbers do not
    if options < 2 or shots > len(NAMES) or (distractors == "demos" and options > shots):
        at_most = f" <= shots ({shots})" if distractors == "demos" else f", shots ({shots})"
        raise InvalidInput(f"need 2 <= options ({options}){at_most} <= {len(NAMES)}")
    rng = np.random.default_rng(seed)
    names = list(rng.choice(NAMES, shots, replace=False))
    codes = [str(c) for c in rng.choice(np.arange(100, 1000), shots, replace=False)]
    demos = [f"The code of {n} is {c}." for n, c in zip(names, codes)]
    unused = np.setdiff1d(np.arange(100, 1000), np.asarray(codes, dtype=int))
    items = []
    for _ in range(n_items):
        if distractors == "demos":
            picks = rng.choice(shots, options, replace=False)
            answer = int(rng.integers(options))
            asked, numbers = picks[answer], [codes[p] for p in picks]
        else:  # the asked fact's number among options - 1 that no demonstration holds
            asked, answer = int(rng.integers(shots)), int(rng.integers(options))
            numbers = [str(c) for c in rng.choice(unused, options - 1, replace=False)]
            numbers.insert(answer, codes[asked])
        items.append({"query": f" The code of {names[asked]} is",
                      "options": [f" {c}" for c in numbers], "answer": answer})
    return demos, items


def read_items(path: Path) -> list[dict]:
    """The items of a JSON-lines file, each with its own `demos`: a line without them takes the last
    ones given above it."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows or "demos" not in rows[0]:
        raise InvalidInput(f"{path}: the first line must carry 'demos' (a list of strings)")
    demos = None
    for i, r in enumerate(rows):
        missing = {"query", "options", "answer"} - r.keys()
        if missing:
            raise InvalidInput(f"{path}: line {i + 1} lacks {sorted(missing)}")
        demos = r.setdefault("demos", demos)
        if not isinstance(demos, list) or not all(isinstance(d, str) for d in demos):
            raise InvalidInput(f"{path}: line {i + 1}: 'demos' must be a list of strings")
    return rows


def anchors_of(model_dir: Path, tok, override: list[str] | None) -> tuple[str, tuple[int, ...], str]:
    """(variant, anchor ids, placement) from `--anchor-tokens` or the `kvjax_anllm` entry of config.json."""
    if override:
        return "ep", anchor_ids_of(tok, override), "sentence"
    meta = json.loads((model_dir / "config.json").read_text()).get("kvjax_anllm")
    if meta is None:
        raise InvalidInput(f"{model_dir}/config.json has no 'kvjax_anllm' entry (not from kvjax.experiments.train_anllm); "
                         "pass --anchor-tokens")
    return meta["variant"], tuple(meta["anchor_ids"]), meta.get("placement", "sentence")


def summarise(records: list[dict], n_demos: float, l_kv: float, timing: fewshot.Timing | None, full_cache_s) -> dict:
    """`n_demos` / `l_kv`: the demonstrations' length and their anchor cache's, averaged over the items."""
    acc = lambda key: float(np.mean([int(np.argmax(r[key])) == r["answer"] for r in records]))
    out = {"items": len(records), "L_d": n_demos, "L_kv": l_kv, "C_down": 1 - l_kv / n_demos,
           "acc_full": acc("full"), "acc_ansan": acc("ansan"),
           "chance": float(np.mean([1 / len(r["full"]) for r in records]))}
    if timing is not None:
        out |= {"non_caching_s": timing.non_caching_s, "anchor_caching_s": timing.caching_s,
                "T_up": timing.speedup, "full_caching_s": full_cache_s,
                "T_up_vs_full_caching": full_cache_s / timing.caching_s}
    return out


def write_report(out: Path, summary: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    write_atomic(out / "results.json", dumps_finite(summary))  # the report reads its verdict from here: no NaN
    rows = [("items", summary["items"]), ("Acc full attention", f"{summary['acc_full']:.3f}"),
            ("Acc +AnSAN", f"{summary['acc_ansan']:.3f}"), ("chance", f"{summary['chance']:.3f}"),
            ("L_d", f"{summary['L_d']:g}"), ("L_kv", f"{summary['L_kv']:g}"), ("C⇓", f"-{100 * summary['C_down']:.0f}%")]
    if "T_up" in summary:
        rows += [("T⇑ (vs non-caching)", f"×{summary['T_up']:.2f}"),
                 ("T⇑ (vs full caching)", f"×{summary['T_up_vs_full_caching']:.2f}")]
    (out / "results.md").write_text(f"# {title}\n\n| metric | value |\n|---|---|\n"
                                    + "".join(f"| {k} | {v} |\n" for k, v in rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
    a.bar(["L_d", "L_kv"], [summary["L_d"], summary["L_kv"]], color=["grey", "tab:blue"])
    a.set_title(f"cache length (C⇓ -{100 * summary['C_down']:.0f}%)")
    b.bar(["full", "+AnSAN", "chance"], [summary["acc_full"], summary["acc_ansan"], summary["chance"]],
          color=["grey", "tab:blue", "lightgrey"])
    b.set_ylim(0, 1)
    b.set_title("accuracy")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.eval_anllm", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help=model_help())
    p.add_argument("--out", required=True, help="where the results go (a folder; a rerun resumes there)")
    p.add_argument("--data", help="JSON lines of items (default: the built-in fact-retrieval task)")
    p.add_argument("--anchor-tokens", nargs="*", help="anchor token strings (default: from config.json)")
    p.add_argument("--items", type=positive_int, help=f"built-in task: items (default {BUILTIN['items']})")
    p.add_argument("--shots", type=positive_int, help=f"built-in task: demonstrations (default {BUILTIN['shots']})")
    p.add_argument("--options", type=positive_int, help=f"built-in task: options an item (default {BUILTIN['options']})")
    p.add_argument("--distractors", choices=DISTRACTORS,
                   help="built-in task: the wrong options are other demonstrations' numbers (demos, the default: "
                        "associative recall) or numbers no demonstration holds (absent: finding the one read)")
    p.add_argument("--time-items", type=nonnegative_int, default=20, help="items timed for T⇑ (0: no timing)")
    p.add_argument("--placement", help="AnLLM-AC: where <AC> goes in the demonstrations: sentence, every:N or "
                                       "random:P (Table 3; default: where the model was trained with it)")
    p.add_argument("--seed", type=nonnegative_int, default=0,
                   help="the random seed of the built-in task's facts and of --placement random:P")
    add_run_args(p)
    args = p.parse_args(argv)
    # the options the items from --data would silently ignore are refused
    task = driver.call(p, driver.builtin_task, args.data, BUILTIN, items=args.items, shots=args.shots,
                       options=args.options, distractors=args.distractors)
    args.items, args.shots, args.options, args.distractors = (task[k] for k in ("items", "shots", "options",
                                                                                 "distractors"))

    lm = driver.load_model(args.model, allow_nonfinite=args.allow_nonfinite)
    model, tok = lm.model, lm.tokenizer
    variant, anchor_ids, placement = anchors_of(lm.path, tok, args.anchor_tokens)
    if args.placement is not None:
        from kvjax.anllm_anchors import parse_placement

        try:
            parse_placement(args.placement)
        except ValueError as err:
            raise InvalidInput(f"--placement {args.placement}: {err}") from None
        if variant != "ac":
            raise InvalidInput(f"--placement {args.placement} needs an AnLLM-AC model: EP's anchor is the "
                               "sentence-final token")
        placement = args.placement
    if args.data:
        rows = read_items(Path(args.data))
    else:
        demos, rows = fact_task(args.items, args.shots, args.options, args.seed, args.distractors)
        rows = [{**r, "demos": demos} for r in rows]
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    sentence_ac = variant == "ac" and placement == "sentence"

    def demo_tokens(demos: list[str]) -> list[int]:
        ids = []
        for d in demos:
            ids += encode((" " if ids else "") + d + (AC_TOKEN if sentence_ac else ""))
        if variant == "ac" and not sentence_ac:  # Table 3's placements
            ids = place_anchors(ids, anchor_ids[0], placement, args.seed)
        return ids

    # One anchor cache per distinct demonstrations, shared by the items that have them.
    prefixes: dict[tuple[str, ...], tuple] = {}
    items, which = [], []
    for r in rows:
        key = tuple(r["demos"])
        it = Item(tuple(encode(r["query"])), tuple(tuple(encode(o)) for o in r["options"]), int(r["answer"]))
        items.append(it)
        which.append(key)
    for key in dict.fromkeys(which):
        demo_ids = demo_tokens(list(key))
        if not demo_ids:
            raise InvalidInput("an item has no demonstrations (an empty 'demos' list)")
        n_anchor = sum(t in anchor_ids for t in demo_ids)
        last = max([i for i, t in enumerate(demo_ids) if t in anchor_ids], default=-1)
        policy = AnchorReduction(anchor_ids=anchor_ids, anchor_slots=max(n_anchor, 1),
                                 sequence=max(len(demo_ids) - 1 - last, 1))
        mine = [it for it, k in zip(items, which) if k == key]
        cache = fewshot.prefix_cache(model, demo_ids, policy, fewshot.room_for(mine))
        prefixes[key] = (demo_ids, policy, cache, fewshot.cache_length(cache))

    out = Path(args.out)
    # Every option shapes the items or the anchors: no resuming over another configuration's records.
    log = driver.call(p, driver.open_records, out, lm, "items.jsonl", {
        "data": args.data, "anchor_tokens": args.anchor_tokens, "items": args.items, "shots": args.shots,
        "options": args.options, "distractors": args.distractors, "seed": args.seed, "placement": args.placement},
        files=("data",), key="i")
    for i in progress_bar(range(len(items)), desc="items", initial=len(log), total=len(items)):
        if i not in log:
            it = items[i]
            demo_ids, policy, cache, _ = prefixes[which[i]]
            log.add({"i": i, "answer": it.answer, "full": fewshot.full_scores(model, demo_ids, it).tolist(),
                     "ansan": fewshot.cached_scores(model, cache, len(demo_ids), it, policy).tolist()})
    records = [log.records[str(i)] for i in range(len(items))]
    demo_ids, policy, _, _ = prefixes[which[0]]
    l_d = float(np.mean([len(prefixes[k][0]) for k in which]))
    l_kv = float(np.mean([prefixes[k][3] for k in which]))

    timing = full_cache_s = None
    if args.time_items > 0:
        timed = [it for it, k in zip(items, which) if k == which[0]][: args.time_items]  # one prefix
        timing = fewshot.time_caching(model, demo_ids, timed, policy)
        full_cache_s = fewshot.time_caching(model, demo_ids, timed, FullCache()).caching_s
    summary = summarise(records, l_d, l_kv, timing, full_cache_s)
    summary |= {"model": shown(lm.path), "variant": variant, "placement": placement, "anchor_ids": list(anchor_ids),
                "data": args.data or (f"facts(shots={args.shots}, options={args.options}, seed={args.seed}"
                                     + (f", distractors={args.distractors})" if args.distractors != "demos" else ")"))}
    write_report(out, summary, f"AnLLM-{variant.upper()} {lm.path.name}: {summary['data']}")
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
