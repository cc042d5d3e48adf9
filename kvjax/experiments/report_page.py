"""A report page's tables and verdicts, regenerated from the records committed beside it.

    python -m kvjax.experiments.report_page docs/report-smollm2.md            # rewrite the page's generated blocks
    python -m kvjax.experiments.report_page docs/report-smollm2.md --check    # exit 1 where the page differs

A generated block opens with `<!-- records: KIND PATH [KEY=VALUE ...] -->` (PATH: a run directory, relative to the
page; the options are the block's, e.g. `only=snapkv,kvzip`) and ends with `<!-- /records -->`; everything between is the function `BLOCKS[KIND]` of that directory's records, and is
overwritten. The prose around a block is the page's own. So every number a block shows comes from committed
records, and `tests/test_report_page.py` holds the committed page to its records. Reads files only: no model.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

from kvjax.experiments import cli, verdicts
from kvjax.experiments import passkey as passkey_suite
from kvjax.experiments.held import mean_held, shown_held
from kvjax.experiments.records import read_json, read_records, write_atomic
from kvjax.experiments.ruler import compare
from kvjax.errors import InvalidInput, MissingFile
from kvjax.cli import HelpFormatter

OPEN = re.compile(r"<!-- records: (\S+) (\S+)((?: \S+=\S+)*) -->\n(.*?)<!-- /records -->", re.S)


def _records(path: Path, what: str) -> list[dict]:
    """The JSON lines of a records file (`kvjax.experiments.records.read_records`: a missing, torn, non-finite or
    repeated record is one line naming it; `what`: whose records)."""
    return read_records(path, what, key="i" if path.name == "items.jsonl" and "anllm" in str(path) else "id")


def ruler(run: Path, where: str, only: str | None = None, plot: str | None = None, versus: str | None = None, *,
          figures: Path | None = None) -> str:
    """A RULER run (`kvjax.experiments.ruler`, or the report's RULER section) at `run` (`where` from the page): its
    configuration from identity.json, prompts found per policy and task, and SlimKV's claim by `compare.slimkv_claims`.
    `only`: the methods shown ("snapkv,kvzip": their labels at every ratio), the full cache always. `plot`: a PNG
    (relative to the page) of each method's share of prompts found against the KV bytes it held, drawn into the
    directory `figures` (the page's) when given: a check compares the text and draws nothing. `versus`
    ("kvzip:snapkv,kvgrad:kvzip"): claims "A >= B" at each ratio both ran (`compare.versus_claims`)."""
    identity = read_json(run / "identity.json")
    rows = compare.read(run)
    if only:
        keep = {"full", *only.split(",")}
        rows = [r for r in rows if compare.split_label(r["label"])[0] in keep]
        if not rows:
            raise InvalidInput(f"{where}: no records of {only}")
    fmt = identity.get("--chat-template", "off (records from before the option)")
    lines = [f"Records: `{where}` ({len(rows)}{', ' + only if only else ''}), chat template {fmt}, protocol "
             f"{identity['--protocol']}, batch {identity['--batch']}, seed {identity['--seed']}, "
             f"{identity['model dtype']} weights {identity['weights']}.", "", compare.table(rows), "",
             "Against the full cache: each policy's share minus the full cache's, in points, paired over the same "
             "prompts. KV held: the share of the full cache's KV bytes the compressed prompt held (blank: records "
             "from before the measurement).", ""]
    if plot:
        if figures is not None:
            compare.plot_held(rows, figures / plot)
        lines += [f"![score against KV bytes held]({plot})", ""]
    if versus:
        pairs = [tuple(pair.split(":")) for pair in versus.split(",")]
        if any(len(pair) != 2 for pair in pairs):
            raise InvalidInput(f"{where}: versus={versus} is not A:B,C:D")
        lines += ["Each claim \"A >= B\" by the rule of `kvjax.experiments.verdicts` (holds / does not hold beyond two "
                  "paired standard errors, else inconclusive), paired over the prompts both have:", ""]
        lines += [f"- {c}" for c in compare.versus_claims(rows, pairs)] + [""]
    claims = compare.slimkv_claims(rows)
    if claims:
        lines += ["SlimKV's claim, by the rule of `kvjax.experiments.verdicts` (holds / does not hold beyond two paired "
                  "standard errors, else inconclusive):", ""] + [f"- {c}" for c in claims] + [""]
    return "\n".join(lines)


# zero-shot policies by the class their description opens with; MAT is a ByLayer whose deep layers hold anchors
_ZS_METHODS = {"FullCache": "full", "StreamingLLM": "streaming", "SnapKV": "snapkv"}


def _zs_method(description: str) -> tuple[str, float | None]:
    """("mat", 0.5) for MAT's ByLayer(... AnchorCache(... ratio=0.5 ...)), ("streaming", 0.5) for StreamingLLM
    at ratio 0.5, ("full", None) for the full cache."""
    head = compare.family(description)
    name = "mat" if head == "ByLayer" and "AnchorCache(" in description else _ZS_METHODS.get(head)
    if name is None:
        raise InvalidInput(f"zero-shot records: policy {description[:60]!r} is not one the page's sweep shows")
    m = re.search(r"\bratio=([0-9.]+)", description)
    return name, (float(m.group(1)) if m else None)


def zeroshot(run: Path, where: str, items: str = "sweep-items.jsonl", ratios: str | None = None, *,
             figures: Path | None = None) -> str:
    """A zero-shot sweep (`kvjax.experiments.zeroshot`'s per-item records, `items` in `run`): items right per method
    and KV share (acc, then acc_norm), and MAT's claim (accuracy at least StreamingLLM's at every share) paired
    over the items both read, each share by the rule and the sweep by `all_of`. `ratios` ("0.5,0.875"): the
    sweep's ratios, so one with no records shows as not run rather than disappearing."""
    cells: dict[tuple[str, float | None], dict[int, dict]] = {}
    for r in _records(run / items, "zero-shot"):
        cells.setdefault(_zs_method(r["policy"]), {})[int(r["id"].rsplit("|", 1)[1])] = r
    found = {r for _, r in cells if r is not None}
    ratios = sorted(found | ({float(r) for r in ratios.split(",")} if ratios else set()))
    methods = [m for m in ("streaming", "mat", "snapkv") if any((m, r) in cells for r in found)]
    n = max(len(v) for v in cells.values())

    def cell(key) -> str:
        got = cells.get(key)
        if not got:
            return "not run"
        acc, norm = (sum(r[k] for r in got.values()) for k in ("acc", "acc_norm"))
        return f"{acc}/{len(got)} ({norm}/{len(got)})" + (f", {n - len(got)} items not run" if len(got) < n else "")

    lines = [f"Records: `{where}/{items}`, {n} items per cell; items right, acc (acc_norm).", "",
             "| KV % | full cache | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods),
             f"| 100 | {cell(('full', None))} |" + " |" * len(methods)]
    lines += [f"| {100 * (1 - r):g} | | " + " | ".join(cell((m, r)) for m in methods) + " |" for r in ratios]
    said = []
    lines += ["", "MAT's claim (accuracy at least StreamingLLM's at every KV share), paired over the items both "
              "read, by the rule of `kvjax.experiments.verdicts`:", ""]
    for r in ratios:
        mat, stream = cells.get(("mat", r), {}), cells.get(("streaming", r), {})
        both = sorted(mat.keys() & stream.keys())
        if len(both) < 2:
            lines.append(f"- at {100 * (1 - r):g} %: **inconclusive** (not run: {len(both)} items both read)")
            said.append(verdicts.INCONCLUSIVE)
            continue
        diff, se, k = verdicts.paired_gap({i: float(mat[i]["acc"]) for i in both},
                                          {i: float(stream[i]["acc"]) for i in both})
        said.append(verdicts.verdict(diff, se, k))
        lines.append(f"- at {100 * (1 - r):g} %: **{said[-1]}** (accuracy, MAT minus StreamingLLM: "
                     + verdicts.evidence(diff, se, paired=True, n=k) + ")")
    lines += ["", f"At every share: **{verdicts.all_of(said)}**.", ""]
    return "\n".join(lines)


def _trained_tokens(run: Path) -> int:
    """Tokens a training run read: its logged steps x batch x accumulation x sequence length (train_identity.json
    and loss.json, as `kvjax.experiments.train_anllm` and `kvjax.experiments.train_gate` write them)."""
    ident = read_json(run / "train_identity.json")
    steps = len(read_json(run / "loss.json"))
    return steps * ident["--batch"] * ident.get("--accum", 1) * ident["--seq-len"]


def _training(run: Path, paper_tokens: str) -> tuple[float, str]:
    """(the share of the paper's training tokens the run in `run` read, the sentence that says so)."""
    tokens = _trained_tokens(run)
    share = tokens / float(paper_tokens)
    return share, f"Trained on {tokens:,} tokens ({share:.2g} of the paper's {float(paper_tokens):,.0f})."


def gate(run: Path, where: str, paper_tokens: str, results: str = "results.json", *, figures: Path | None = None
         ) -> str:
    """Attention-Gate (`kvjax.experiments.eval_gate`'s results.json in `run`, beside its training records): the
    continuation NLL per policy with paired standard errors, and Table 1's claim (the gates lose no more than the
    best training-free baseline; `results` names the file, e.g. the baselines at 50 % eviction).
    `paper_tokens`: the paper's continual pre-training tokens."""
    r = read_json(run / results)
    share, trained = _training(run, paper_tokens)
    c, se_full, vs = r["continuation_nll"], r["delta_se"], r.get("gate_minus_baseline", {})
    at = ("the gates' measured eviction" if r.get("baseline_eviction_source") == "gates"
          else "a fixed eviction") + f", {r['baseline_eviction']:.1%}"
    lines = [f"Records: `{where}/{results}` ({r['windows']} windows of {r['seq_len']} tokens, the first "
             f"{r['prefix']} prefilled; the baselines at {at}). {trained}", "",
             "| policy | NLL of the continuation | vs full (s.e.) | the gates minus this policy (s.e.) |",
             "|---|---|---|---|"]
    for name, nll in c.items():
        d = "" if name == "full" else f"{nll - c['full']:+.4f} ({se_full[name]:.4f})"
        g = f"{vs[name]['diff']:+.4f} ({vs[name]['se']:.4f})" if name in vs else ""
        lines.append(f"| {name} | {nll:.4f} | {d} | {g} |")
    best = min(vs, key=lambda k: c[k])
    diff, se = -vs[best]["diff"], vs[best]["se"]  # positive: the gates lose less than the best baseline
    kept = r.get("kept_prefix", {})
    apart = verdicts.unmatched(kept.get("gate"), kept.get(best))
    said = apart or verdicts.trained(verdicts.verdict(diff, se), share)
    lines += ["", f"Table 1's claim (the gates lose no more than the best baseline, here {best}): {said} ("
              + verdicts.evidence(diff, se, paired=True, n=r["windows"], of="windows", training_share=share,
                                  digits=4) + ").", ""]
    return "\n".join(lines)


def anllm(run: Path, where: str, paper_tokens: str, base: str, trained: str, *, figures: Path | None = None) -> str:
    """AnLLM (`kvjax.experiments.eval_anllm`'s results of the untrained model, `base`, and of the trained variant,
    `trained`, json files in `run`): Table 1's columns, and its claim (with only the anchors cached, accuracy
    within 0.05 of full attention's), unpaired binomial (the files keep accuracies, not items)."""
    rows = {name: read_json(run / f) for name, f in (("untrained", base), ("trained", trained))}
    share, training = _training(run, paper_tokens)
    t = rows["trained"]
    lines = [f"Records: `{where}/{base}`, `{where}/{trained}` ({t['items']} items, {t['data']}, chance "
             f"{t['chance']:.2f}). {training}", "",
             "| model | Acc, full attention | Acc, anchors only (AnSAN) | L_kv / L_d | T⇑ vs full caching |",
             "|---|---|---|---|---|"]
    for name, r in rows.items():
        n = r["items"]
        lines.append(f"| {name} | {r['acc_full']:.3f} ({round(r['acc_full'] * n)}/{n}) | {r['acc_ansan']:.3f} "
                     f"({round(r['acc_ansan'] * n)}/{n}) | {r['L_kv']:g} / {r['L_d']:g} | "
                     f"x{r['T_up_vs_full_caching']:.2f} |")
    diff = t["acc_ansan"] - t["acc_full"] + 0.05
    se = verdicts.binomial_se(t["acc_ansan"], t["acc_full"], t["items"])
    lines += ["", anllm_table1_claim(t, diff, se, None, share), ""]
    return "\n".join(lines)


def anllm_table1_claim(t: dict, diff: float, se: float | None, paired: int | None, share: float | None) -> str:
    """AnLLM Table 1's claim (AnSAN within 0.05 of full attention's accuracy) on the summary `t`: the margin left
    `diff` with standard error `se` (`paired`: over that many items, else unpaired binomial), or no verdict where
    full attention is at chance."""
    # the claim is measured against full attention's accuracy: at chance, the task says nothing about the cache
    margin = verdicts.SE_MULTIPLE * max(math.sqrt(t["chance"] * (1 - t["chance"]) / t["items"]), 1 / t["items"])
    if t["acc_full"] <= t["chance"] + margin:
        said = (f"**no verdict**: full attention's accuracy ({t['acc_full']:.3f}) is within "
                f"{verdicts.SE_MULTIPLE} binomial standard errors of chance, so the task does not test the cache")
    else:
        said = verdicts.trained(verdicts.verdict(diff, se, paired), share)
    return (f"Table 1's claim (AnSAN within 0.05 of full attention's accuracy): {said} (the margin left, AnSAN minus "
            "full plus 0.05: " + verdicts.evidence(diff, se, paired=paired is not None, n=paired or t["items"],
                                                   training_share=share) + ").")


_PLACEMENTS = {"sentence": "every demonstration (sentence)", "every-10": "every 10 tokens", "random-0.1": "random, p = 0.1"}


def anllm_placements(run: Path, where: str, paper_tokens: str, task: str = "absent", *,
                     figures: Path | None = None) -> str:
    """AnLLM-AC's Table 3 (`kvjax.experiments.eval_anllm --placement P` of one trained model, per-item records in
    `run`/eval-TASK-P for P in sentence, every-10, random-0.1): accuracy per placement, Table 1's claim at the
    training's placement (sentence), and Table 3's claim (every demonstration beats the other two placements with
    the anchors alone), each paired over the items."""
    share, training = _training(run, paper_tokens)
    rows, right = {}, {}
    for p in _PLACEMENTS:
        d = run / f"eval-{task}-{p}"
        rows[p] = read_json(d / "results.json") if (d / "results.json").is_file() else None
        if rows[p] is None:
            raise MissingFile(f"{d}/results.json: no AnLLM-AC evaluation at placement {p} there")
        recs = _records(d / "items.jsonl", "AnLLM item")
        right[p] = {k: {r["i"]: float(max(range(len(r[k])), key=r[k].__getitem__) == r["answer"]) for r in recs}
                    for k in ("full", "ansan")}
        for k in ("full", "ansan"):
            if abs(sum(right[p][k].values()) / len(recs) - rows[p][f"acc_{k}"]) > 1e-9:
                raise InvalidInput(f"{where}/eval-{task}-{p}: results.json's acc_{k} is not its items' ")
    t = rows["sentence"]
    lines = [f"Records: `{where}/eval-{task}-{{{','.join(_PLACEMENTS)}}}` ({t['items']} items each, {t['data']}, "
             f"chance {t['chance']:.2f}; the same trained AnLLM-AC model, its <AC> placed as Table 3 does). {training}",
             "", "| <AC> placement in the demonstrations | Acc, full attention | Acc, anchors only (AnSAN) | "
             "L_kv / L_d |", "|---|---|---|---|"]
    for p, name in _PLACEMENTS.items():
        r, n = rows[p], rows[p]["items"]
        lines.append(f"| {name} | {r['acc_full']:.3f} ({round(r['acc_full'] * n)}/{n}) | {r['acc_ansan']:.3f} "
                     f"({round(r['acc_ansan'] * n)}/{n}) | {r['L_kv']:g} / {r['L_d']:g} |")
    margin = {i: right["sentence"]["ansan"][i] - right["sentence"]["full"][i] + 0.05 for i in right["sentence"]["full"]}
    diff, se = sum(margin.values()) / len(margin), verdicts.paired_se(list(margin.values()))
    lines += ["", "Each claim by the rule of `kvjax.experiments.verdicts`, paired over the items:", "",
              "- " + anllm_table1_claim(t, diff, se, len(margin), share)]
    for p in ("every-10", "random-0.1"):
        diff, se, k = verdicts.paired_gap(right["sentence"]["ansan"], right[p]["ansan"])
        lines.append(f"- Table 3's claim, every demonstration >= {_PLACEMENTS[p]} (AnSAN accuracy): "
                     + verdicts.trained(verdicts.verdict(diff, se, k), share) + " ("
                     + verdicts.evidence(diff, se, paired=True, n=k, training_share=share) + ")")
    return "\n".join(lines + [""])


def kvpress(run: Path, where: str, *, figures: Path | None = None) -> str:
    """kvpress's pipeline beside kvjax (`kvjax.experiments.kvpress_agreement`'s answers.jsonl in `run`): per method and
    ratio, the samples where kvpress gives kvjax's answer, and every answer that differs."""
    from kvjax.experiments import kvpress_agreement

    rows = _records(run / "answers.jsonl", "kvpress agreement")
    identity = read_json(run / "identity.json")
    methods = list(dict.fromkeys(r["method"] for r in rows))
    ratios = sorted({r["ratio"] for r in rows if r["ratio"] is not None})
    per_task = {t: len({r["index"] for r in rows if r["task"] == t}) for t in dict.fromkeys(r["task"] for r in rows)}
    text, _ = kvpress_agreement.table(rows, methods, ratios)
    same = sum(r["same"] for r in rows)
    return "\n".join([
        f"Records: `{where}` ({len(rows)} answers; " + ", ".join(f"{t}: {n} prompts" for t, n in per_task.items())
        + f"; chat template {'on' if identity['--chat-template'] else 'off'}, protocol {identity['--protocol']}). "
        f"kvpress gives kvjax's answer in **{same} of {len(rows)}**.", "", text, ""])


# passkey and perplexity records name a policy by its description; a block names it by its class and width
_NAMES = {"FullCache": "full", "StreamingLLM": "streaming", "H2O": "h2o", "RazorAttention": "razor", "SnapKV": "snapkv"}


def _name(description: str) -> str:
    """"streaming" for StreamingLLM(...), "full@2" for Quantized(FullCache(...), bits=2, ...): a block's key."""
    head = compare.family(description)
    if head == "Quantized":
        bits = re.findall(r"\bbits=(\d+)", description)[-1]  # the outermost: Quantized's own arguments come last
        return f"{_name(description[len('Quantized('):])}@{bits}"
    return _NAMES.get(head, head.lower())


def _shown(description: str) -> str:
    """A row's name: the class and its budget ("StreamingLLM(3243)"), a quantized cache's width and scheme."""
    head = compare.family(description)
    if head == "Quantized":
        inner = description[len("Quantized("):]
        bits = int(_name(description).rsplit("@", 1)[1])
        group, residual = (re.findall(rf"\b{k}=(\d+)", description) for k in ("group", "residual"))
        scheme = "int8 per token" if bits == 8 else f"KIVI {bits}-bit" + (f", G {group[-1]}" if group else "") + (
            f", R {residual[-1]}" if residual else "")
        return f"{_shown(inner)}, {scheme}"
    whole = re.search(r"(\d+/\d+) KV heads kept whole", description)  # RazorAttention's head table
    if whole:
        return f"{head}({whole.group(1)} KV heads whole)"
    budget = re.search(r"\bbudget=(\d+)", description)
    return "full cache" if head == "FullCache" else head + (f"({budget.group(1)})" if budget else "")


def _versus_pairs(where: str, versus: str, names) -> list[tuple[str, str]]:
    """[("a", "b"), ...] of a block's `versus=a:b,...`, each side one of `names`."""
    pairs = [tuple(pair.split(":")) for pair in versus.split(",")]
    if any(len(pair) != 2 or not set(pair) <= set(names) for pair in pairs):
        raise InvalidInput(f"{where}: versus={versus} is not A:B,... over the records' policies ({', '.join(names)})")
    return pairs


def passkey(run: Path, where: str, versus: str | None = None, label: str | None = None, *,
            figures: Path | None = None) -> str:
    """Passkey retrieval (`kvjax.experiments.passkey`'s samples.jsonl in `run`): keys found per policy and prompt length,
    by depth, the KV bytes held; `versus` ("razor:streaming,razor:h2o", the blocks' names: `_name`) claims "A >= B"
    at each length, paired over the (depth, sample) prompts both ran, by the rule of `kvjax.experiments.verdicts`.
    `label` ("a6a52c5c:retrieval,0/90:none"): a policy whose description holds the text before a colon is named by
    the word after it, for runs where two policies of one class would share a name (RazorAttention's head tables)."""
    rows = _records(run / "samples.jsonl", "passkey")
    relabel = [tuple(x.split(":", 1)) for x in label.split(",")] if label else []
    if any(len(x) != 2 for x in relabel):
        raise InvalidInput(f"{where}: label={label} is not TEXT:NAME,...")
    named = lambda desc: next((n for text, n in relabel if text in desc), None) or _name(desc)  # noqa: E731
    names = {}
    for r in rows:
        if names.setdefault(named(r["policy"]), r["policy"]) != r["policy"]:
            raise InvalidInput(f"{where}: two policies are named {named(r['policy'])!r} ({names[named(r['policy'])][:60]}"
                               f"... and {r['policy'][:60]}...): give label=TEXT:NAME")
    labelled = {n for _, n in relabel}
    show = lambda n: _shown(names[n]) + (f" [{n}]" if n in labelled else "")  # noqa: E731
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    found = {(n, L): passkey_suite.found_by_prompt(rows, desc, L) for n, desc in names.items() for L in lengths}
    held = {(n, L): mean_held([r for r in rows if r["policy"] == names[n] and r["length"] == L])
            for n in names for L in lengths}
    identity = read_json(run / "identity.json") if (run / "identity.json").is_file() else {}
    how = "".join(f", {k.lstrip('-')} {identity[k]}" for k in ("--protocol", "--batch", "--seed") if k in identity)
    if "weights" in identity:
        how += f", {identity['model dtype']} weights {identity['weights']}"
    lines = [f"Records: `{where}` ({len(rows)} prompts answered{how}). Keys found, of the prompts at each length "
             "(KV held: the share of the full cache's KV bytes the compressed prompt held):", "",
             "| policy | " + " | ".join(f"{L} tokens | KV held" for L in lengths) + " |",
             "|---|" + "---|---|" * len(lengths)]
    for n in names:
        cells = [f"{int(sum(found[n, L].values()))} / {len(found[n, L])} | {shown_held(held[n, L])}"
                 if found[n, L] else " | " for L in lengths]
        lines.append(f"| {show(n)} | " + " | ".join(cells) + " |")
    lines += ["", "By depth (% of the prompts at that length and depth):", "",
              "| policy | length | " + " | ".join(f"depth {d:g}" for d in depths) + " |",
              "|---|---|" + "---|" * len(depths)]
    for n in names:
        for L in lengths:
            if not found[n, L]:
                continue
            at = [[v for (d, _), v in found[n, L].items() if d == depth] for depth in depths]
            lines.append(f"| {show(n)} | {L} | " + " | ".join(f"{100 * sum(a) / len(a):.0f}" if a else ""
                                                               for a in at) + " |")
    if versus:
        pairs = _versus_pairs(where, versus, names)
        lines += ["", "Each claim \"A >= B\" by the rule of `kvjax.experiments.verdicts` (holds / does not hold beyond two "
                  "paired standard errors, else inconclusive), paired over the prompts both ran:", ""]
        for a, b in pairs:
            for L in lengths:
                both = found[a, L].keys() & found[b, L].keys()
                if not both:
                    lines.append(f"- {a} >= {b} at {L} tokens: **no verdict**, no prompt both ran")
                    continue
                diff, se, k = verdicts.paired_gap({x: found[a, L][x] for x in both}, {x: found[b, L][x] for x in both})
                diff, se = 100 * diff, None if se is None else 100 * se
                lines.append(f"- {show(a)} >= {show(b)} at {L} tokens: "
                             f"**{verdicts.verdict(diff, se, k)}** (keys found, in points, "
                             + verdicts.evidence(diff, se, paired=True, n=k, of="prompts", digits=1)
                             + ("" if None in (held[a, L], held[b, L]) else
                                f"; KV held {shown_held(held[a, L])} against {shown_held(held[b, L])}") + ")")
    return "\n".join(lines + [""])


def quantization(run: Path, where: str, within: str = "0.05", *, figures: Path | None = None) -> str:
    """A quantized cache (the report's quantization section in `run`: perplexity/ and passkey/): perplexity per
    width, and the claim that each width keeps the full cache's perplexity within `within` (a share), paired over
    the sequences by the rule; then the passkey table (`passkey`)."""
    path = run / "perplexity" / "results.json"
    if not path.is_file():
        raise MissingFile(f"{path}: no perplexity records there")
    r = read_json(path)
    margin = math.log1p(float(within))
    values = [v for per in r["ppl"].values() for v in per.values()] + [
        x for per in r["nll_per_sequence"].values() for seq in per.values() for x in seq]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        raise InvalidInput(f"{path}: a perplexity or NLL that is not a finite number (a skipped or failed run)")
    lengths = {L for per in r["ppl"].values() for L in per}
    if len(lengths) != 1:
        raise InvalidInput(f"{path}: records at lengths {sorted(lengths)}; the block shows one length")
    (length,) = lengths
    names = {_name(d): d for d in r["policies"].values()}
    label = {_name(d): lab for lab, d in r["policies"].items()}
    bases = list(dict.fromkeys(n.split("@")[0] for n in names))
    widths = sorted({int(n.split("@")[1]) for n in names if "@" in n}, reverse=True)
    seqs = len(next(iter(r["nll_per_sequence"].values()))[length])
    ppl = lambda n: r["ppl"][label[n]][length]  # noqa: E731
    nll = lambda n: r["nll_per_sequence"][label[n]][length]  # noqa: E731
    lines = [f"Records: `{where}/perplexity` ({seqs} sequence(s) of {length} tokens, read token by token through "
             f"the stored cache) and `{where}/passkey`. Perplexity, and its change from the same policy in the model's "
             "dtype:", "", "| cache | " + " | ".join(_shown(names[b]) for b in bases) + " |",
             "|---|" + "---|" * len(bases), "| the model's dtype | " + " | ".join(f"{ppl(b):.2f}" for b in bases) + " |"]
    for w in widths:
        cells = [f"{ppl(f'{b}@{w}'):.2f} ({100 * (ppl(f'{b}@{w}') / ppl(b) - 1):+.1f} %)" for b in bases]
        lines.append(f"| {_shown(names[f'{bases[0]}@{w}']).split(', ', 1)[1]} | " + " | ".join(cells) + " |")
    lines += ["", f"Each claim \"a width keeps the policy's perplexity in the model's dtype within "
              f"{100 * float(within):g} %\" by the rule of `kvjax.experiments.verdicts`: log({1 + float(within):g}) minus the log-perplexity gap, paired over the "
              "sequences (one sequence has no standard error: inconclusive):", ""]
    for b in bases:
        for w in widths:
            gaps = [q - f for q, f in zip(nll(f"{b}@{w}"), nll(b))]
            diff = margin - sum(gaps) / len(gaps)
            se = verdicts.paired_se(gaps)
            lines.append(f"- {_shown(names[f'{b}@{w}'])}: **{verdicts.verdict(diff, se, len(gaps))}** ("
                         f"{ppl(f'{b}@{w}'):.2f} against {ppl(b):.2f}; "
                         + verdicts.evidence(diff, se, paired=True, n=len(gaps), of="sequences", digits=4) + ")")
    if (run / "passkey").is_dir():
        lines += ["", "Passkey (the prompt attended in the model's dtype, then stored: the width acts on the answer's "
                  "tokens):", "", passkey(run / "passkey", f"{where}/passkey")]
    return "\n".join(lines + [""])


def needle(run: Path, where: str, versus: str | None = None, *, figures: Path | None = None) -> str:
    """Needle in a haystack (`kvjax.experiments.needle`'s cells.jsonl in `run`): each policy's answer per length and
    depth (the key fact in bold where it is there), exact matches, the cells where a policy's answer is not the
    full cache's, and `versus` ("razor:streaming") claims "A >= B" in exact matches at each length, paired over
    the depths by the rule of `kvjax.experiments.verdicts`."""
    rows = _records(run / "cells.jsonl", "needle")
    identity = read_json(run / "identity.json")
    labels = list(dict.fromkeys(r["label"] for r in rows))
    lengths, depths = sorted({r["length"] for r in rows}), sorted({r["depth"] for r in rows})
    cell = {(r["label"], r["length"], r["depth"]): r for r in rows}
    key = identity["--answer"]
    shown = lambda r: "(not run)" if r is None else (  # noqa: E731
        "(empty)" if not r["answer"].strip() else
        (f"**{r['answer'].strip()}**" if r["exact"] else r["answer"].strip()).replace("|", "\\|").replace("\n", " "))
    lines = [f"Records: `{where}` ({len(rows)} answers: one prompt per policy, length and depth; protocol "
             f"{identity['--protocol']}, {identity['model dtype']} weights {identity['weights']}; exact: the answer "
             f"holds {key!r}, in bold).", "",
             "| policy | length | " + " | ".join(f"depth {d:g}" for d in depths) + " | exact | KV held |",
             "|---|---|" + "---|" * len(depths) + "---|---|"]
    for lab in labels:
        for L in lengths:
            got = [cell.get((lab, L, d)) for d in depths]
            ran = [r for r in got if r is not None]
            lines.append(f"| {_shown(ran[0]['policy']) if ran else lab} | {L} | " + " | ".join(map(shown, got))
                         + f" | {sum(r['exact'] for r in ran)} / {len(ran)} | {shown_held(mean_held(ran))} |")
    if "full" in labels:
        lines += [""]
        for lab in labels[1:] if labels[0] == "full" else [x for x in labels if x != "full"]:
            differ = [(L, d) for L in lengths for d in depths if (lab, L, d) in cell and ("full", L, d) in cell
                      and cell[lab, L, d]["answer"].strip() != cell["full", L, d]["answer"].strip()]
            lines.append(f"- {lab}: the full cache's answer, word for word, in "
                         f"{sum((lab, L, d) in cell for L in lengths for d in depths) - len(differ)} of its cells"
                         + (f"; not at {', '.join(f'{L} tokens depth {d:g}' for L, d in differ)}" if differ else ""))
    if versus:
        lines += ["", "Each claim \"A >= B\" in exact matches by the rule of `kvjax.experiments.verdicts`, paired over the "
                  "depths (one prompt each):", ""]
        for a, b in _versus_pairs(where, versus, labels):
            for L in lengths:
                both = [d for d in depths if (a, L, d) in cell and (b, L, d) in cell]
                if not both:
                    lines.append(f"- {a} >= {b} at {L} tokens: **no verdict**, no prompt both ran")
                    continue
                diff, se, k = verdicts.paired_gap({d: float(cell[a, L, d]["exact"]) for d in both},
                                                  {d: float(cell[b, L, d]["exact"]) for d in both})
                lines.append(f"- {a} >= {b} at {L} tokens: **{verdicts.verdict(diff, se, k)}** (exact matches, "
                             + verdicts.evidence(diff, se, paired=True, n=k, of="prompts") + ")")
    return "\n".join(lines + [""])


def _longbench_records(run: Path, where: str) -> tuple[dict, dict[tuple[str, str], dict[str, float]]]:
    """(result.json, {(label, task): {sample id: score in [0, 100]}}) of a LongBench-format run, each per-sample
    score recomputed from the predictions, which must give result.json's."""
    from kvjax.experiments.longbench import metrics

    path = run / "result.json"
    if not path.is_file():
        raise MissingFile(f"{path}: no LongBench records there")
    r = read_json(path)
    sample = {}
    for lab in r["policies"]:
        for d in r["datasets"]:
            metric = r["scores"][lab][d]["metric"]
            preds = read_records(run / "preds" / r["slugs"][lab] / f"{d}.jsonl", "LongBench", key="_id")
            sample[lab, d] = {p["_id"]: 100 * metrics.sample_score(d, metric, p["pred"], p["answers"],
                                                                    p["all_classes"]) for p in preds}
            if abs(metrics.score([v / 100 for v in sample[lab, d].values()]) - r["scores"][lab][d]["score"]) > 0.01:
                raise InvalidInput(f"{where}: {lab} on {d}: the predictions do not give result.json's score")
    return r, sample


def longbench_claims(run: Path, where: str, versus: str) -> list[str]:
    """Each claim "A >= B" of `versus` ("slimkv:snapkv-avg,...") on a LongBench-format run, by the rule: per-sample
    scores paired over every (task, sample) both predicted (the suite's average, as the papers' LongBench claims
    are made) and over the tasks the full cache scores above zero on; each names the settings the two share and
    those they do not (budget, observation window, kernel, pooling)."""
    r, sample = _longbench_records(run, where)
    tasks = r["datasets"]
    done = [d for d in tasks if "full" in r["policies"] and r["scores"]["full"][d]["score"] > 0]
    lines = []
    for a, b in _versus_pairs(where, versus, r["policies"]):
        budget = lambda desc: (re.findall(r"\bbudget=(\w+)", desc) or ["-"])[0]  # noqa: E731
        sa, sb = ({"budget": budget(r["policies"][x]), **compare.settings(r["policies"][x])} for x in (a, b))
        same = [f"{k} {sa[k].strip(chr(39))}" for k in sa if sb.get(k) == sa[k]]
        differ = [f"{k} {sa[k].strip(chr(39))} vs {sb.get(k, '-').strip(chr(39))}" for k in sa if sb.get(k) != sa[k]]
        matched = "matched: " + (", ".join(same) or "nothing") + ("; NOT matched: " + ", ".join(differ) if differ else "")
        for what, over in (("the suite's average", tasks), (f"the tasks the full cache does ({', '.join(done)})", done)):
            if not over:
                continue
            diff, se, k = verdicts.paired_gap({(d, i): v for d in over for i, v in sample[a, d].items()},
                                              {(d, i): v for d in over for i, v in sample[b, d].items()})
            said = f"**no verdict**, not matched ({', '.join(differ)})" if differ else f"**{verdicts.verdict(diff, se, k)}**"
            lines.append(f"{a} >= {b} on {what}: {said} ("
                         + verdicts.evidence(diff, se, paired=True, n=k, of="samples", digits=1) + f"; {matched})")
    return lines


def longbench(run: Path, where: str, versus: str | None = None, *, figures: Path | None = None) -> str:
    """The LongBench-format suite (`kvjax.experiments.longbench`'s result.json and per-policy predictions in `run`):
    score per task and policy, the KV held, and `versus`'s claims (`longbench_claims`)."""
    r, sample = _longbench_records(run, where)
    identity = read_json(run / "identity.json")
    labels, tasks = list(r["policies"]), r["datasets"]
    n = {len(v) for v in sample.values()}
    lines = [f"Records: `{where}` ({'/'.join(map(str, sorted(n)))} samples per task; chat template "
             f"{'on' if identity['--chat'] else 'off'}, protocol {identity['--protocol']}, batch {identity['--batch']}, "
             f"{identity['model dtype']} weights {identity['weights']}, harness config "
             f"{identity['harness config']}). Policies: " + "; ".join(
                 f"**{lab}** `{desc}`" for lab, desc in r["policies"].items()) + ".", "",
             "| task | metric | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    for d in tasks:
        lines.append(f"| {d} | {r['scores'][labels[0]][d]['metric']} | "
                     + " | ".join(f"{r['scores'][lab][d]['score']:.1f}" for lab in labels) + " |")
    avg = {lab: sum(r["scores"][lab][d]["score"] for d in tasks) / len(tasks) for lab in labels}
    lines.append("| average | | " + " | ".join(f"{avg[lab]:.1f}" for lab in labels) + " |")
    lines.append("| KV held | | " + " | ".join(shown_held(r["kv_held"].get(lab)) for lab in labels) + " |")
    if versus:
        lines += ["", "Each claim \"A >= B\" by the rule of `kvjax.experiments.verdicts` (holds / does not hold beyond two "
                  "paired standard errors, else inconclusive), per-sample scores (0-100) paired over the samples "
                  "both predicted:", ""] + [f"- {c}" for c in longbench_claims(run, where, versus)]
    return "\n".join(lines + [""])


def memory(run: Path, where: str, project: str = "8000x8", *, figures: Path | None = None) -> str:
    """Peak resident memory (`benchmarks.memory`'s rss.json in `run`): each cell's peak, the growth per prompt
    token held in a batch between each two cells that differ in one of (tokens, prompts), the base it implies,
    the full cache's own bytes per token (from the model's shape), and `project` ("TOKENSxPROMPTS") from them."""
    path = run / "rss.json"
    if not path.is_file():
        raise MissingFile(f"{path}: no peak-memory records there")
    r = read_json(path)
    cells = r["cells"]
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    lines = [f"Records: `{where}/rss.json` ({r['machine']}, Python {r['python']}, {r['dtype']} weights; each command "
             "in its own process, its peak resident set as the kernel counts it):", "",
             "| command | prompts in the batch | prompt tokens | peak RSS |", "|---|---|---|---|"]
    lines += [f"| `{c['command']}` | {c['prompts']} | {c['prompt_tokens']} | {gb(c['peak_rss_bytes'])} |" for c in cells]
    slopes = []
    for i, a in enumerate(cells):
        for b in cells[i + 1:]:
            held = b["prompts"] * b["prompt_tokens"] - a["prompts"] * a["prompt_tokens"]
            if (a["prompts"] == b["prompts"]) != (a["prompt_tokens"] == b["prompt_tokens"]) and held:
                slopes.append(((b["peak_rss_bytes"] - a["peak_rss_bytes"]) / held, a, b, held))
    if not slopes:
        raise InvalidInput(f"{where}: no two cells differ in tokens or prompts alone; no growth per token to give")
    slope = sum(x[0] for x in slopes) / len(slopes)
    first = cells[0]
    base = first["peak_rss_bytes"] - slope * first["prompts"] * first["prompt_tokens"]
    width = 2 if "bfloat16" in r["dtype"] else 4
    cache = r["layers"] * r["kv_heads"] * r["head_dim"] * 2 * width
    if not re.fullmatch(r"[1-9]\d*x[1-9]\d*", project):
        raise InvalidInput(f"{where}: project={project} is not TOKENSxPROMPTS")
    tokens, prompts = (int(v) for v in project.split("x"))
    lines += ["", "Growth per prompt token held in a batch, between cells that differ in one of the two: " + "; ".join(
        f"{x[0] / 1e3:.0f} KB ({gb(x[2]['peak_rss_bytes'])} - {gb(x[1]['peak_rss_bytes'])} over {x[3]} tokens)"
        for x in slopes) + f". Their mean, {slope / 1e3:.0f} KB a token, over a base of {gb(base)} (the first cell "
        f"less its tokens). Of it, the full cache itself is {cache / 1e3:.0f} KB a token ({r['layers']} layers x "
        f"{r['kv_heads']} KV heads x {r['head_dim']} x 2 (keys and values) x {width} bytes). So {prompts} prompts "
        f"of {tokens} tokens in one batch need about {gb(base + slope * tokens * prompts)}.", ""]
    return "\n".join(lines)


def _anchor_slots(description: str) -> int:
    m = re.search(r"\banchor_slots=(\d+)", description)
    if m is None:
        raise InvalidInput(f"perplexity records: MAT policy {description[:60]!r} names no anchor_slots")
    return int(m.group(1))


def _nll_by_sequence(path: Path, where: str) -> tuple[dict, dict[tuple[str, int | None], dict[int, float]]]:
    """(identity.json, {(label, β or None): {sequence: NLL}}) of a perplexity run (`kvjax.experiments.perplexity`'s
    runs.jsonl), one length; a skipped or non-finite record is an error (the block states numbers only)."""
    identity = read_json(path / "identity.json")
    cells: dict[tuple[str, int | None], dict[int, float]] = {}
    lengths = set()
    for r in _records(path / "runs.jsonl", "perplexity"):
        if "skipped" in r or not math.isfinite(r.get("nll", math.nan)):
            raise InvalidInput(f"{where}: record {r['id']} has no finite NLL ({r.get('skipped', 'not a number')})")
        lengths.add(r["length"])
        beta = _anchor_slots(r["policy"]) if "AnchorCache(" in r["policy"] else None
        cells.setdefault((r["label"], beta), {})[r["sequence"]] = r["nll"]
    if len(lengths) != 1:
        raise InvalidInput(f"{where}: records at lengths {sorted(lengths)}; the block shows one length")
    return identity | {"length": lengths.pop()}, cells


def perplexity(run: Path, where: str, *, figures: Path | None = None) -> str:
    """MAT against StreamingLLM at equal budget (MAT Table 3's comparison): `run` holds `full/` (the full cache)
    and `rolling-B/` per budget B (`kvjax.experiments.perplexity --compare streaming,mat --budget B [--anchor-grid ...]`).
    From the per-sequence records: each cache's perplexity, MAT's β chosen as the run's `--anchor-tuning` says
    (recomputed here, and checked against the run's results.json), the perplexity at each β of the grid, and the
    claim "MAT's perplexity is below StreamingLLM's" per budget, paired over the sequences by the rule."""
    from kvjax.experiments.perplexity import leave_one_out

    full_id, full = _nll_by_sequence(run / "full", f"{where}/full")
    if ("full", None) not in full:
        raise InvalidInput(f"{where}/full: no records labelled full")
    full_nll = full[("full", None)]
    dirs = sorted(d.name for d in run.glob("rolling-*") if d.is_dir())
    if not dirs:
        raise MissingFile(f"{run}: no rolling-BUDGET run directories")
    if bad := [d for d in dirs if not d.removeprefix("rolling-").isdigit()]:
        raise InvalidInput(f"{where}/{bad[0]}: not rolling-BUDGET (a whole number of slots)")
    budgets = sorted(int(d.removeprefix("rolling-")) for d in dirs)
    ppl = lambda xs: math.exp(sum(xs) / len(xs))  # noqa: E731  (equal lengths: the token-weighted mean)
    rows, grids, claims, hows, counts = [], [], [], set(), set()
    for b in budgets:
        d = f"{where}/rolling-{b}"
        identity, cells = _nll_by_sequence(run / f"rolling-{b}", d)
        if ("streaming", None) not in cells:
            raise InvalidInput(f"{d}: no StreamingLLM records (label streaming)")
        stream = cells[("streaming", None)]
        seqs = sorted(stream)
        grid = {beta: nll for (lab, beta), nll in cells.items() if lab == "mat"}
        if not grid:
            raise InvalidInput(f"{d}: no MAT records (label mat)")
        tuning = identity.get("--anchor-tuning", "next-window") if identity.get("--anchor-grid") else None
        want = set(seqs) | ({len(seqs)} if tuning == "next-window" else set())  # next-window: the tuning window too
        if odd := [beta for beta, nll in grid.items() if set(nll) != want]:
            raise InvalidInput(f"{d}: MAT at β {odd[0]} has sequences {sorted(grid[odd[0]])}, not {sorted(want)}")
        if tuning is None:
            if len(grid) != 1:
                raise InvalidInput(f"{d}: MAT at β {sorted(grid)} without an --anchor-grid to choose among them")
            chosen = list(grid) * len(seqs)
            hows.add("one value, not tuned")
        elif tuning == "leave-one-out":
            chosen = leave_one_out({beta: [nll[i] for i in seqs] for beta, nll in sorted(grid.items())})
            hows.add("per sequence, the lowest mean NLL on the other sequences (leave-one-out)")
        else:
            pick = min(sorted(grid), key=lambda beta: grid[beta][len(seqs)])  # the window after the scored ones
            chosen = [pick] * len(seqs)
            hows.add("the lowest NLL on a window after the scored ones")
        counts.add(len(seqs))
        mat = {i: grid[beta][i] for i, beta in zip(seqs, chosen)}
        results = read_json(run / f"rolling-{b}" / "results.json")
        length = str(identity["length"])
        for lab, nll in (("streaming", stream), ("mat", mat)):
            if not math.isclose(results["ppl"][lab][length], ppl(list(nll.values())), rel_tol=1e-3):
                raise InvalidInput(f"{d}: results.json's {lab} perplexity {results['ppl'][lab][length]} is not its "
                                   f"records' {ppl(list(nll.values())):.3f}")
        diff, se, k = verdicts.paired_gap(stream, mat)
        said = verdicts.verdict(diff, se, k)
        rows.append(f"| {b} | {ppl(list(stream.values())):.2f} | {ppl(list(mat.values())):.2f} | "
                    f"{', '.join(map(str, chosen))} | {diff:+.4f} |")
        grids.append(f"- budget {b}: " + "; ".join(f"β {beta}: {ppl([grid[beta][i] for i in seqs]):.2f}"
                                                  for beta in sorted(grid)))
        claims.append(f"- budget {b}: **{said}** (log-perplexity, StreamingLLM minus MAT: "
                      + verdicts.evidence(diff, se, paired=True, n=k, of="sequences", digits=4) + ")")
    if len(hows) != 1 or len(counts) != 1:
        raise InvalidInput(f"{where}: the budgets were run differently (MAT's β: {sorted(hows)}; sequences: "
                           f"{sorted(counts)}); one block states one protocol")
    lines = [f"Records: `{where}/full` ({len(full_nll)} sequence(s)) and `{where}/rolling-{{{','.join(map(str, budgets))}}}` "
             f"({counts.pop()} sequences of {full_id['length']} tokens each, read token by token through the cache, "
             f"rolling positions; {full_id['model dtype']} weights {full_id['weights']}). MAT's β: {hows.pop()}.", "",
             "| KV budget per layer and head | StreamingLLM | MAT | MAT's β per sequence | log-ppl, StreamingLLM "
             "minus MAT |", "|---|---|---|---|---|",
             f"| full cache ({full_id['length']}) | {ppl(list(full_nll.values())):.2f} | "
             f"{ppl(list(full_nll.values())):.2f} | | |", *rows, "",
             "MAT's perplexity over the same sequences at each β of the grid (the chosen β above are picked without "
             "the sequence they score):", "", *grids, "",
             "MAT's claim (Table 3: its perplexity below StreamingLLM's at the same budget), paired over the "
             "sequences by the rule of `kvjax.experiments.verdicts`:", "", *claims, ""]
    return "\n".join(lines)


_TABLE1 = {"FullCache": "full", "GateEviction": "gate", "StreamingLLM": "streaming", "ObservedAttention": "h2o"}


def gate_zeroshot(run: Path, where: str, paper_tokens: str, items: str = "zeroshot/items.jsonl", *,
                  figures: Path | None = None) -> str:
    """Attention-Gate's Table 1 protocol (`kvjax.experiments.zeroshot --gate-params G --compare
    full,gate,streaming,h2o-prefill --ratio 0.5`'s per-item records, `items` in `run`, beside the gates' training
    records): accuracy and the KV each policy held, measured per item, and Table 1's claim (the gates' accuracy
    at least each training-free baseline's) paired over the items, by the rule; no verdict where the full cache
    is within two binomial standard errors of chance."""
    records = _records(run / items, "zero-shot")
    share, trained = _training(run, paper_tokens)
    cells: dict[str, dict[int, dict]] = {}
    for r in records:
        name = _TABLE1.get(compare.family(r["policy"]))
        if name is None:
            raise InvalidInput(f"{where}: policy {r['policy'][:60]!r} is not one of Table 1's ({', '.join(_TABLE1)})")
        cells.setdefault(name, {})[int(r["id"].rsplit("|", 1)[1])] = r
    if "gate" not in cells or "full" not in cells:
        raise InvalidInput(f"{where}: Table 1 needs the full cache and the gates; the records have {', '.join(cells)}")
    if any(r.get("kv_share") is None for v in cells.values() for r in v.values()):
        raise InvalidInput(f"{where}: an item without its measured KV share (stream scoring measures none); Table "
                           "1's claim is made at a measured eviction")
    n = len(cells["full"])
    chance = sum(1 / len(r["logprobs"]) for r in cells["full"].values()) / n
    acc = {k: sum(r["acc"] for r in v.values()) / len(v) for k, v in cells.items()}
    task = next(iter(cells["full"].values()))["id"].split("|", 1)[0]
    lines = [f"Records: `{where}/{items}` ({n} items of {task}, chance {chance:.2f}). {trained}", "",
             "| policy | KV held (mean over items) | acc | acc_norm |", "|---|---|---|---|"]
    for k, v in cells.items():
        held = sum(r["kv_share"] for r in v.values()) / len(v)
        lines.append(f"| {k} | {held:.3f} | {sum(r['acc'] for r in v.values())}/{len(v)} | "
                     f"{sum(r['acc_norm'] for r in v.values())}/{len(v)} |")
    margin = verdicts.SE_MULTIPLE * max(math.sqrt(chance * (1 - chance) / n), 1 / n)
    lines += ["", "Table 1's claim (the gates' accuracy at least each baseline's), paired over the items, by the rule "
              "of `kvjax.experiments.verdicts`:", ""]
    for b in (k for k in cells if k not in ("full", "gate")):
        both = sorted(cells["gate"].keys() & cells[b].keys())
        diff, se, k = verdicts.paired_gap({i: float(cells["gate"][i]["acc"]) for i in both},
                                          {i: float(cells[b][i]["acc"]) for i in both})
        held = lambda name: sum(cells[name][i]["kv_share"] for i in both) / len(both)  # noqa: E731
        apart = verdicts.unmatched(held("gate"), held(b))
        said = (f"**no verdict**: the full cache's accuracy ({acc['full']:.3f}) is within {verdicts.SE_MULTIPLE} "
                "binomial standard errors of chance, so the task does not test the cache"
                if acc["full"] <= chance + margin else apart if apart
                else verdicts.trained(verdicts.verdict(diff, se, k), share))
        lines.append(f"- gates >= {b}: {said} (accuracy, " + verdicts.evidence(
            diff, se, paired=True, n=k, training_share=share) + f"; KV held {held('gate'):.3f} against {held(b):.3f})")
    return "\n".join(lines + [""])


BLOCKS: dict[str, Callable[..., str]] = {"ruler": ruler, "zeroshot": zeroshot, "gate": gate, "anllm": anllm,
                                         "kvpress": kvpress, "passkey": passkey, "quantization": quantization,
                                         "needle": needle, "longbench": longbench, "memory": memory,
                                         "gate-zeroshot": gate_zeroshot, "perplexity": perplexity,
                                         "anllm-placements": anllm_placements}


def regenerate(page: Path, draw: bool = False) -> str:
    """`page`'s text with every generated block rewritten from its records; `draw`: the blocks' figures too."""
    text = page.read_text()

    def block(m: re.Match) -> str:
        kind, where, extra = m.group(1), m.group(2), m.group(3)
        if kind not in BLOCKS:
            raise InvalidInput(f"{page}: block kind {kind!r} is unknown (known: {', '.join(BLOCKS)})")
        run = page.parent / where
        if not run.is_dir():
            raise MissingFile(f"{page}: block {kind} reads {run}, which is not a directory")
        options = dict(kv.split("=", 1) for kv in extra.split())
        try:
            text = BLOCKS[kind](run, where, **options, figures=page.parent if draw else None)
        except TypeError as err:
            raise InvalidInput(f"{page}: block {kind} {where}: {err}") from None
        return f"<!-- records: {kind} {where}{extra} -->\n{text}<!-- /records -->"

    return OPEN.sub(block, text)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.report_page", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("page", help="the markdown page (its blocks name record directories relative to it)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page differs from its records")
    args = p.parse_args(argv)
    page = Path(args.page)
    if not page.is_file():
        raise MissingFile(f"{page}: no such page")
    new = regenerate(page, draw=not args.check)
    if args.check:
        if new != page.read_text():
            print(f"{page}: its generated blocks differ from its records (python -m kvjax.experiments.report_page {page})",
                  file=sys.stderr)
            return 1
        return 0
    if new != page.read_text():
        write_atomic(page, new)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, compile_cache=None))
