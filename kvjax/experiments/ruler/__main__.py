"""RULER under kvjax cache policies: its synthetic tasks generated offline at any length with the
model's own tokenizer, scored as RULER scores (string_match_all).

    python -m kvjax.experiments.ruler --model DIR --lengths 4096,16384 --compare full,snapkv --budget 1024
    python -m kvjax.experiments.ruler --model DIR --preset leaderboard --lengths 4096    # kvpress's leaderboard
    python -m kvjax.experiments.ruler --tasks niah_single_1,niah_multikey_2 --max-new-tokens 32 \\
        --compare full,streaming,snapkv --budget 128                               # the default model

`--protocol agnostic` (kvpress's protocol, the default) compresses each sample's context without
its question, then appends the question (with RULER's answer prefix) to the compressed cache;
`--protocol aware` compresses context and question together. Both read the same token ids.
`--chat-template auto|on|off` (default auto: on iff the tokenizer has a template, as kvpress's pipeline): the
context wrapped in the chat template's user turn, the question, the end of the turn, the assistant header and
the answer prefix after it; off: BOS + context, then question + "\n" + answer prefix (kvpress without a template).
`--ratios` runs every policy at each compression ratio: each policy with a ratio mode (all but full
and gate) removes that fraction of each prompt; MAT's beta, a count, defaults to a quarter of that
share of the cell's prompt room (length - tokens to generate). Generated samples are kept in OUT/data, predictions appended
per sample to OUT/preds.jsonl (a rerun resumes), scores in OUT/results.{md,csv,json} and the plots
OUT/score_vs_length.png and (with --ratios) OUT/score_vs_ratio.png, each method's score against the KV bytes
it really held (a record's `kv_held`: the share of the full cache's bytes for its prompt, `kvjax.cache.held_bytes`),
the tables' "KV held" column.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvjax.experiments import cli, driver
from kvjax.experiments.common import (
    add_chat_template_arg,
    add_compare_args,
    add_run_args,
    chat_template_mode,
    chat_template_on,
    compared,
    int_list,
    model_help,
    nonnegative_int,
    parse_ratios,
    positive_int,
    prompt_ids,
    suite_model,
)
from kvjax.experiments.held import kv_held, mean_held
from kvjax.experiments.records import content_fingerprint, shown, write_atomic, write_csv_atomic
from kvjax.experiments.ruler import scoring
from kvjax.experiments.ruler import tasks as T
from kvjax import Sampling, generate_many
from kvjax.errors import InvalidInput
from kvjax.cli import HelpFormatter

# kvpress's public leaderboard: RULER at 4K, these compression ratios, the presses kvjax shares with
# kvpress (StreamingLLM, SnapKV, PyramidKV, TOVA, KNorm, ObservedAttention) plus the papers' methods.
LEADERBOARD_RATIOS = (0.25, 0.5, 0.75, 0.875, 0.9375, 0.96875)  # to 32:1 (kvpress #286, #288)
LEADERBOARD_POLICIES = ("full", "streaming", "snapkv", "pyramidkv", "tova", "knorm", "h2o-prefill", "mat", "slimkv",
                        "h2o", "adakv", "expected-attention", "keydiff", "kvzip")


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.ruler", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", help=model_help("the embedded default model"))
    p.add_argument("--lengths", type=int_list, help="sequence lengths in tokens, prompt + generation "
                                                    "(default: the model's max_position_embeddings)")
    p.add_argument("--tasks", help=f"comma-separated (default: RULER's offline tasks {','.join(T.OFFICIAL)}); "
                                   f"all: {','.join(T.TASKS)}")
    p.add_argument("--samples", type=positive_int, default=10, help="samples per task and length")
    p.add_argument("--data-dir", help=f"RULER's QA files ({', '.join(T.QA_FILES.values())}, from RULER's "
                                      "download_qa_dataset.sh) for qa_1 / qa_2; without it those are not run")
    p.add_argument("--seed", type=nonnegative_int, default=T.DEFAULT_SEED, help="RULER's random_seed")
    p.add_argument("--protocol", choices=["agnostic", "aware"], default="agnostic",
                   help="agnostic: compress the context without the question (kvpress); aware: with it")
    add_chat_template_arg(p)
    p.add_argument("--max-new-tokens", type=positive_int,
                   help="override RULER's tokens to generate (niah 128, vt 30, cwe 120, fwe 50), also in the fitting")
    p.add_argument("--ratios", help="comma-separated compression ratios: every policy at each")
    p.add_argument("--preset", choices=["leaderboard"],
                   help="leaderboard: the ratios 0.25,0.5,0.75,0.875,0.9375,0.96875 (to 32:1) and the policies kvjax "
                        "shares with kvpress plus the papers' (razor with --heads, gate with --gate-params)")
    p.add_argument("--batch", type=positive_int, default=4, help="samples generated together (of one task and length)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the weights' and the cache's dtype")
    p.add_argument("--attention-impl", default="xla", choices=["xla", "pallas"],
                   help="pallas: the kernels of kvjax.pallas (interpret mode on CPU: slow, for checking)")
    p.add_argument("--out", default="results/ruler",
                   help="where the results go (a folder; a rerun with the same options resumes there)")
    add_compare_args(p, default="full,streaming,snapkv")
    add_run_args(p)
    args = p.parse_args(argv)
    names = args.tasks.split(",") if args.tasks else list(T.OFFICIAL)
    unknown = [n for n in names if n not in T.TASKS]
    if unknown:
        p.error(f"argument --tasks: unknown task {unknown[0]!r}; RULER's offline tasks: {', '.join(T.TASKS)}")
    args.task_names = names
    if args.data_dir and not set(names) & set(T.NEEDS_DATA):
        p.error(f"--data-dir {args.data_dir}: only {', '.join(T.NEEDS_DATA)} read it, and --tasks has neither")
    if args.preset:
        if args.ratios or args.compare or args.policy:
            p.error("--preset leaderboard sets --ratios and --compare itself")
        extra = [n for n, given in (("razor", args.heads), ("gate", args.gate_params), ("duo", args.duo_pattern))
                 if given]
        args.compare, args.ratios = ",".join(LEADERBOARD_POLICIES + tuple(extra)), LEADERBOARD_RATIOS
    else:
        parse_ratios(p, args)
    return p, args


def cell_policies(p, args, num_layers: int, model_dir=None):
    """The command line's policies: a `{label: policy}`, or with --ratios a function of a cell's prompt
    room (length - generated) giving each policy at each ratio (MAT's default beta a quarter of that
    ratio's share of the room)."""
    return compared(p, args, num_layers, model_dir, by_room=True)


def cell_samples(out: Path, lm, task: T.Task, length: int, count: int, seed: int, gen: int, data_dir=None,
                 chat: bool = False) -> list[T.Sample]:
    """The cell's `count` samples, generated once and kept in OUT/data (the identity ties them to the
    tokenizer and the seed)."""
    path = out / "data" / f"{task.name}-{length}.jsonl"
    if path.is_file():
        try:
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            if len(rows) >= count:
                return [T.Sample(**{**r, "outputs": tuple(r["outputs"])}) for r in rows[:count]]
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as err:
            raise InvalidInput(f"{path} is not a sample file kvjax wrote ({type(err).__name__}: {err}); delete it to "
                               "generate the samples again") from None
    samples = T.generate(task, length, count, prompt_counter(lm.tokenizer, chat), seed=seed, tokens_to_generate=gen,
                         data_dir=data_dir)
    write_atomic(path, "".join(json.dumps(s.__dict__ | {"outputs": list(s.outputs)}) + "\n" for s in samples))
    return samples


def encode(tok, sample: T.Sample, chat: bool) -> tuple[list[int], list[int]]:
    """(context ids, question ids) as kvpress's pipeline makes them (`kvjax.experiments.common.prompt_ids`: with the chat
    template, or BOS + context and question + "\n" + answer prefix): one tokenisation for both protocols."""
    return prompt_ids(tok, sample.context, sample.question, sample.answer_prefix, on=chat)


def prompt_counter(tok, chat: bool):
    """Tokens of the prompt the model reads for RULER's text (input + answer prefix): `T.token_counter`'s, plus what
    the prompt format adds (`encode`: the template's turns, or "\n" before the answer prefix), so a sample fits its
    length in that format."""
    count = T.token_counter(tok)
    extra = sum(map(len, prompt_ids(tok, "", "", "", on=chat))) - count("")
    return lambda text: count(text) + extra


class Cell(NamedTuple):
    """One sample of a task at a length under one policy; `policies` those of its task and length."""

    task: T.Task
    length: int
    gen: int  # tokens to generate
    sample: T.Sample
    label: str
    policies: dict

    @property
    def policy(self):
        return self.policies[self.label]


def record_id(protocol: str, task: T.Task, length: int, policy, sample: T.Sample, chat: str = "off") -> str:
    """A record's key; the chat template's ("template-on") only when on, so the raw-text key is what it was."""
    return f"{policy.describe()}|{protocol}{'|template-on' if chat == 'on' else ''}|{task.name}|{length}|{sample.index}"


def predict(lm, cells: list[Cell], protocol: str, chat: str = "off", batch: int | None = None) -> list[dict]:
    """The records of `cells` (a batch of samples of one task and length): the policies of the batch run together
    (`generate_many`: the prompt compressors share one pass over the prompts), as `batch` rows (a smaller last batch
    padded, so that it compiles nothing new)."""
    tok = lm.tokenizer
    task, length, gen = cells[0].task, cells[0].length, cells[0].gen
    chunk = list({c.sample.index: c.sample for c in cells}.values())
    asked = {(c.sample.index, c.label) for c in cells}
    wanted = {lab: p for lab, p in cells[0].policies.items() if any(c.label == lab for c in cells)}
    ids = [encode(tok, s, chat == "on") for s in chunk]
    if protocol == "agnostic":
        outs = generate_many(lm.model, [c for c, _ in ids], list(wanted.values()), questions=[q for _, q in ids],
                             max_new_tokens=gen, sampling=Sampling(), pad_id=tok.pad_token_id, keep_caches=False,
                             pad_rows=batch)
    else:
        outs = generate_many(lm.model, [c + q for c, q in ids], list(wanted.values()), max_new_tokens=gen,
                             sampling=Sampling(), pad_id=tok.pad_token_id, keep_caches=False, pad_rows=batch)
    records = []
    for (label, policy), gen_out in zip(wanted.items(), outs):
        for s, seq, held in zip(chunk, gen_out.sequences(), gen_out.held_fraction):
            if (s.index, label) not in asked:
                continue
            pred = scoring.postprocess(tok.decode(seq, skip_special_tokens=True))
            records.append({"id": record_id(protocol, task, length, policy, s, chat), "label": label,
                            "policy": policy.describe(), "task": task.name, "length": length, "index": s.index,
                            "pred": pred, "outputs": list(s.outputs),
                            "score": scoring.sample_score(pred, s.outputs, T.METRICS[task.kind]),
                            "kv_held": kv_held(held)})
    return records


def write_report(out: Path, rows: list[dict], meta: dict) -> tuple[str, dict, list[Path]]:
    """(markdown, JSON summary, figures): scores per (label, task, length) as RULER reports them
    (string_match_all), averages, OUT/results.csv and the plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in rows))
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    table, held = {}, {}
    for lab in labels:
        for n in lengths:
            held.setdefault(lab, {})[n] = mean_held([r for r in rows if r["label"] == lab and r["length"] == n])
        for t in tasks:
            for n in lengths:
                cell = [r for r in rows if r["label"] == lab and r["task"] == t and r["length"] == n]
                if cell:
                    table.setdefault(lab, {}).setdefault(t, {})[n] = scoring.METRICS[T.METRICS[T.TASKS[t].kind]](
                        [r["pred"] for r in cell], [r["outputs"] for r in cell])
    avg = {lab: {n: round(float(np.mean([table[lab][t][n] for t in tasks if n in table[lab].get(t, {})])), 2)
                 for n in lengths} for lab in labels}
    result = {**meta, "scores": {lab: {t: {str(n): v for n, v in row.items()} for t, row in ts.items()}
                                 for lab, ts in table.items()},
              "average": {lab: {str(n): v for n, v in row.items()} for lab, row in avg.items()},
              "kv_held": {lab: {str(n): v for n, v in row.items()} for lab, row in held.items()}}
    lines = [f"RULER ({meta['protocol']} protocol, chat template {meta.get('chat_template', 'off')}, "
             f"{meta['samples']} samples per cell, seed {meta['seed']}): "
             f"{meta['model']}", "", "Policies: " + "; ".join(f"**{lab}** = `{meta['policies'][lab]}`" for lab in labels),
             "", "| policy | length | KV held | " + " | ".join(tasks) + " | average |",
             "|---|---|---|" + "---|" * (len(tasks) + 1)]
    rows = [["policy", "length", "kv_held", *tasks, "average"]]
    for lab in labels:
        for n in lengths:
            cells = [table[lab].get(t, {}).get(n) for t in tasks]
            h = held[lab][n]
            lines.append(f"| {lab} | {n} | {'' if h is None else f'{h:.4f}'} | "
                         + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + f" | **{avg[lab][n]:.2f}** |")
            rows.append([lab, n, "" if h is None else h, *cells, avg[lab][n]])
    write_csv_atomic(out / "results.csv", rows)
    unofficial = [t for t in tasks if not T.TASKS[t].official]
    if unofficial:
        lines += ["", f"`{'`, `'.join(unofficial)}`: RULER's essay tasks on standard-library text; not RULER's scores."]
    if any(T.TASKS[t].kind == "qa" for t in tasks):
        lines += ["", "QA is scored as RULER scores it: a sample counts when any reference is in the prediction "
                      "(string_match_part); the other tasks by the share of references found (string_match_all)."]
    lines += ["", "KV held: the share of the full cache's KV bytes the compressed prompt really holds (keys and values "
                  "of the slots holding a token, quantized ones by their codes, scales and residual; mean over the "
                  "cell's samples; blank where a record predates the measurement), whatever the policy's own ratio "
                  "means (DuoAttention's is a share of heads)."]
    if meta.get("not_run"):
        lines += ["", f"Not run: {'; '.join(meta['not_run'])}."]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for lab in labels:
        ax.plot(lengths, [avg[lab][n] for n in lengths], marker="o", label=lab)
    ax.set(xscale="log", xlabel="sequence length (tokens)", ylabel="string_match_all (mean over tasks)", ylim=(-2, 102))
    ax.legend(fontsize=6)
    fig.tight_layout()
    figures = [out / "score_vs_length.png"]
    fig.savefig(figures[0], dpi=110)
    plt.close(fig)
    if any("@" in lab for lab in labels):  # the leaderboard's plot: score against KV bytes held, one panel per task
        n = lengths[-1]
        methods = list(dict.fromkeys(lab.rsplit("@", 1)[0] for lab in labels))
        fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3), squeeze=False)
        for ax, t in zip(axes[0], tasks):
            for m in methods:  # each method on the bytes it held: a label whose records predate the field is left out
                pts = sorted((held[lab][n], table[lab][t][n]) for lab in labels if lab.rsplit("@", 1)[0] == m
                             and n in table[lab].get(t, {}) and held[lab][n] is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=m)
            ax.set(title=f"{t} @ {n}", xlabel="KV bytes held (share of the full cache)", xscale="log", ylim=(-2, 102))
        axes[0][0].set_ylabel("string_match_all")
        axes[0][-1].legend(fontsize=6)
        fig.tight_layout()
        figures.append(out / "score_vs_ratio.png")
        fig.savefig(figures[-1], dpi=110)
        plt.close(fig)
    return "\n".join(lines), result, figures


def suite(lm, policies, out, *, lengths: list[int] | None = None, tasks: list[str] | None = None, samples: int = 10,
          seed: int = T.DEFAULT_SEED, protocol: str = "agnostic", max_new_tokens: int | None = None, batch: int = 4,
          progress: bool = True, data_dir=None, chat_template: str = "auto") -> driver.SuiteResult:
    """RULER's `tasks` (default: its offline ones) at each sequence length (default: the model's
    window) under each policy, into `out`; summary `{"scores": {label: {task: {length: score}}},
    "average": ..., ...}`. `policies` is `{label: policy}` (a list, or one), or a function of a cell's
    prompt room (length - tokens generated) giving them, as a ratio sweep needs. `data_dir`: RULER's QA files
    (`T.QA_FILES`); qa_1 / qa_2 without it are not run, and the table says so. `chat_template`: "auto" (on iff the
    tokenizer has one, as kvpress), "on" or "off" (`kvjax.experiments.common.prompt_ids`); the resolved mode is in the
    identity, every record's key and the table. KVzip's replay must be built for the same mode
    (`driver.resolve_policies(..., chat=True)`): a mismatch is an error."""
    driver.positive(samples, "samples")
    driver.positive(batch, "batch")
    tasks = list(tasks or T.OFFICIAL)
    unknown = [n for n in tasks if n not in T.TASKS]
    if unknown:
        raise driver.ArgumentError(f"tasks={unknown[0]!r} is unknown; RULER's offline tasks: {', '.join(T.TASKS)}")
    if protocol not in ("agnostic", "aware"):
        raise driver.ArgumentError(f"protocol={protocol!r} is not 'agnostic' or 'aware'")
    try:
        chat = "on" if chat_template_on(lm.tokenizer, chat_template) else "off"
    except InvalidInput as err:
        raise driver.ArgumentError(str(err).replace("--chat-template", "chat_template=")) from None
    n_pos = lm.model.cfg.max_position_embeddings
    lengths = list(lengths or [n_pos])
    too_long = [n for n in lengths if n > n_pos]
    if too_long:
        raise driver.ArgumentError(f"lengths={too_long} exceed the model's max_position_embeddings={n_pos}")
    per_cell = (lambda room: driver.labelled(policies(room))) if callable(policies) else (
        lambda room, fixed=driver.labelled(policies): fixed)
    out = Path(out)
    # lengths, tasks and samples only select records
    not_run = [f"{n} (its {T.TASKS[n].arg('dataset')} file: data_dir= / --data-dir)" for n in tasks
               if n in T.NEEDS_DATA and data_dir is None]
    tasks = [n for n in tasks if not (n in T.NEEDS_DATA and data_dir is None)]
    qa_files = sorted({T.QA_FILES[T.TASKS[n].arg("dataset")] for n in tasks if n in T.NEEDS_DATA})
    # the QA files' content is part of what the samples are
    # the resolved prompt format: records made before the option (no such key) are another configuration
    options = {"seed": seed, "protocol": protocol, "chat_template": chat, "max_new_tokens": max_new_tokens,
               "batch": batch}
    if qa_files:
        options["qa_data"] = {f: content_fingerprint(Path(data_dir) / f) if (Path(data_dir) / f).is_file() else None
                              for f in qa_files}
    groups, described = [], {}  # (task, length, tokens to generate, samples, {label: policy}) per cell

    def cells() -> list:  # the samples are written into OUT/data, so they are made once OUT is claimed
        for n in lengths:
            for name in tasks:
                task = T.TASKS[name]
                gen = max_new_tokens or task.tokens_to_generate
                try:
                    cell = cell_samples(out, lm, task, n, samples, seed, gen, data_dir, chat == "on")
                except InvalidInput as err:
                    raise driver.ArgumentError(f"{err}; pass tasks= without {name}, a longer lengths=, or a smaller "
                                               "max_new_tokens=", usage=False) from None
                pols = per_cell(n - gen)
                driver.check_replay(pols, lm.path, chat == "on")
                described.update({label: policy.describe() for label, policy in pols.items()})
                groups.append((task, n, gen, cell, pols))
        return [Cell(task, n, gen, s, lab, pols) for task, n, gen, cell, pols in groups for s in cell for lab in pols]

    rid = lambda c: record_id(protocol, c.task, c.length, c.policy, c.sample, chat)  # noqa: E731

    def report(log):
        rows = [log.records[record_id(protocol, task, n, pol, s, chat)] for task, n, _, cell, pols in groups
                for pol in pols.values() for s in cell]
        meta = {"model": shown(lm.path), "protocol": protocol, "chat_template": chat, "samples": samples, "seed": seed,
                "policies": described, "not_run": not_run}
        if not rows:
            raise driver.ArgumentError(f"no task to run: {'; '.join(not_run)}", usage=False)
        return write_report(out, rows, meta)

    # per batch of samples, the policies still missing a record run together
    suite = driver.Suite("ruler", "preds.jsonl", cells, rid, lambda batch_: predict(lm, batch_, protocol, chat, batch), report,
                         lambda todo: driver.batches(todo, batch, group=lambda c: (c.task.name, c.length),
                                                     unit=lambda c: c.sample.index))
    return driver.run_suite(suite, out, lm, options, lambda: described, progress=progress)


def main(argv: list[str] | None = None) -> int:
    p, args = parse(argv)
    lm = suite_model(args, dtype=args.dtype, attention_impl=args.attention_impl)
    args.replay_chat = chat_template_mode(lm.tokenizer, args.chat_template) == "on"  # KVzip replays in that format
    res = driver.call(p, suite, lm, cell_policies(p, args, lm.config.num_layers, lm.path), args.out,
                      lengths=args.lengths, tasks=args.task_names, samples=args.samples, seed=args.seed,
                      protocol=args.protocol, max_new_tokens=args.max_new_tokens, batch=args.batch,
                      data_dir=args.data_dir, chat_template=args.chat_template)
    print(res.table)
    print(f"wrote {res.out}/results.{{md,csv,json}} and " + ", ".join(str(f) for f in res.figures))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
