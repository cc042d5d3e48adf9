"""The passkey retrieval test (LongLoRA / landmark attention): a five-digit key hidden in repeated
garbage text at a chosen depth, exact-match accuracy per prompt length and depth.

    python -m kvjax.experiments.passkey [--model DIR] [--policy streaming --budget 128] [--lengths 128,256,504]

Prompts are built from token ids so each has exactly the requested length: BOS, the task
description, garbage, the needle at a sentence boundary of the garbage nearest the depth, more
garbage, and "What is the pass key? The pass key is". A sample is correct when the first integer
of the greedy continuation equals the key. Results are appended to OUT/samples.jsonl as they
finish (a rerun resumes) and summarised in OUT/results.{json,md,png}; each record's `kv_held` (the share of
the full cache's KV bytes the compressed prompt really held) is the tables' "KV held" column.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

from kvjax.experiments import cli, driver
from kvjax.experiments.common import (
    add_chat_template_arg,
    add_compare_args,
    add_protocol_arg,
    add_run_args,
    chat_parts,
    chat_template_on,
    compared,
    float_list,
    hint_raw,
    int_list,
    model_help,
    nonnegative_int,
    positive_int,
    split_question,
    suite_model,
)
from kvjax.experiments.held import kv_held, mean_held, shown_held
from kvjax.experiments.records import ResultLog
from kvjax.experiments.tasks import (PASSKEY_ANSWER, PASSKEY_ASK, PASSKEY_GARBAGE, PASSKEY_INTRO, PASSKEY_QUESTION,
                                    passkey_needle)
from kvjax import Sampling, generate_many
from kvjax.errors import InvalidInput
from kvjax.cli import HelpFormatter

MAX_NEW_TOKENS = 8


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _frame(tok, chat: bool) -> tuple[list[int], list[int]]:
    """(the ids before the description, the question's ids). Raw text: BOS, and the question with the answer's start.
    With the chat template (`chat`), as kvpress's pipeline builds a prompt (`common.prompt_ids`): the user turn's
    opening, and the question + the end of the turn + the assistant header + the answer's start."""
    if not chat:
        return [tok.bos_token_id], _encode(tok, PASSKEY_QUESTION)
    head, suffix = chat_parts(tok, True)
    return _encode(tok, head), _encode(tok, PASSKEY_ASK + suffix + PASSKEY_ANSWER)


def passkey_prompt(tok, length: int, depth: float, key: int | str, chat: bool = False) -> tuple[list[int], int]:
    """(prompt ids of exactly `length` tokens, index of the needle's first token); `chat`: in the chat template."""
    if not 0.0 <= depth <= 1.0:
        raise InvalidInput(f"depth={depth} must be in [0, 1]")
    opening, question = _frame(tok, chat)
    head = opening + _encode(tok, PASSKEY_INTRO)
    needle = _encode(tok, passkey_needle(key))
    room = length - len(head) - len(needle) - len(question)
    if room < 0:
        raise InvalidInput(f"length={length} is shorter than the passkey prompt without garbage "
                         f"({length - room} tokens)")
    garbage = _encode(tok, PASSKEY_GARBAGE)
    # The garbage's tail, so it ends with a whole sentence (a partial one, if any, follows the intro).
    filler = (garbage * (room // len(garbage) + 1))[len(garbage) * (room // len(garbage) + 1) - room :]
    # Sentence boundaries: the start, and after each token that ends with ".".
    stops = [0] + [i + 1 for i, t in enumerate(filler) if tok.convert_ids_to_tokens(t).endswith(".")]
    cut = min(stops, key=lambda s: abs(s - depth * room))
    return head + filler[:cut] + needle + filler[cut:] + question, len(head) + cut


def min_length(tok, key: int | str = 10000, chat: bool = False) -> int:
    """Tokens of the passkey prompt without garbage (BOS or the chat's opening, description, needle, question)."""
    opening, question = _frame(tok, chat)
    return len(opening) + len(_encode(tok, PASSKEY_INTRO)) + len(_encode(tok, passkey_needle(key))) + len(question)


def default_lengths(tok, max_position: int, chat: bool = False) -> list[int]:
    """max/4, max/2 and max - MAX_NEW_TOKENS, those the prompt fits in (at least 16 tokens of garbage)."""
    top = max_position - MAX_NEW_TOKENS
    shortest = min_length(tok, chat=chat)
    lengths = sorted({n for n in (max_position // 4, max_position // 2, top) if n >= shortest + 16})
    if not lengths:
        raise InvalidInput(f"max_position_embeddings={max_position} is too short for the passkey prompt "
                         f"({shortest} tokens without garbage)")
    return lengths


def first_int(text: str) -> int | None:
    m = re.search(r"\d+", text)
    return int(m.group()) if m else None


def run(model, tok, policy, lengths, depths, samples: int, log: ResultLog, *, seed: int = 0, batch: int = 8,
        label: str = "", progress: bool = True, protocol: str = "aware") -> list[dict]:
    """Appends a record per (length, depth, sample) not yet in `log`; returns this policy's records."""
    return run_many(model, tok, {label or policy.describe(): policy}, lengths, depths, samples, log, seed=seed,
                    batch=batch, progress=progress, protocol=protocol)[label or policy.describe()]


def run_many(model, tok, policies: dict, lengths, depths, samples: int, log: ResultLog, *, seed: int = 0,
             batch: int = 8, progress: bool = True, protocol: str = "aware") -> dict[str, list[dict]]:
    """`run` for several policies (`{label: policy}`, records labelled by `label`): per batch of prompts, the
    policies still missing a record run together (`generate_many`: those whose prompt is one plain pass
    share it). Returns each label's records."""
    driver.fill(cells(model, tok, policies, lengths, depths, samples, seed=seed, batch=batch, protocol=protocol),
                log, progress)
    return {lab: [r for r in log if r["policy"] == lab] for lab in policies}


def cells(model, tok, policies: dict, lengths, depths, samples: int, *, seed: int = 0, batch: int = 8,
          protocol: str = "aware", report=None, chat: bool = False) -> driver.Suite:
    """The passkey suite: a cell per (length, depth, sample, policy label), its record `label|length|depth|sample`;
    a batch is up to `batch` prompts of one length (one compilation per length), run by the policies still
    missing one of their records together (`generate_many`)."""
    prompts = []
    for length in lengths:
        for depth in depths:
            for i in range(samples):
                rng = np.random.default_rng([seed, length, int(round(depth * 1000)), i])
                prompts.append((length, depth, i, int(rng.integers(10000, 100000))))
    rid = lambda cell: f"{cell[0]}|{cell[1][0]}|{cell[1][1]}|{cell[1][2]}"  # (label, prompt)

    def run(todo: list) -> list[dict]:
        chunk = list(dict.fromkeys(c for _, c in todo))
        wanted = {lab: policies[lab] for lab in dict.fromkeys(lab for lab, _ in todo)}
        asked = set(todo)
        length = chunk[0][0]
        made = [passkey_prompt(tok, length, d, k, chat) for _, d, _, k in chunk]
        contexts, questions = split_question([p for p, _ in made], [len(_frame(tok, chat)[1])] * len(made), protocol)
        outs = generate_many(model, contexts, list(wanted.values()), questions=questions,
                             max_new_tokens=MAX_NEW_TOKENS, sampling=Sampling(), keep_caches=False,
                             pad_rows=batch)
        records = []
        for lab, out in zip(wanted, outs):
            for c, (_, at), seq, held in zip(chunk, made, out.sequences(), out.held_fraction):
                if (lab, c) in asked:
                    text = tok.decode(seq, skip_special_tokens=True)
                    records.append({"id": rid((lab, c)), "policy": lab, "length": length, "depth": c[1], "key": c[3],
                                    "needle_at": at, "output": text, "correct": first_int(text) == c[3],
                                    "kv_held": kv_held(held)})
        return records

    return driver.Suite("passkey", "samples.jsonl", [(lab, c) for c in prompts for lab in policies], rid, run, report,
                        lambda todo: driver.batches(todo, batch, group=lambda cell: cell[1][0],
                                                    unit=lambda cell: cell[1]))


def found_by_prompt(records: list[dict], policy: str, length: int) -> dict[tuple[float, str], float]:
    """`{(depth, sample): 1.0 or 0.0}`: whether `policy`'s record (`policy` as the records name it) of each prompt of
    `length` tokens found the key. A prompt is its length, depth and sample (the same key for every policy:
    `cells`), so two policies' maps pair prompt by prompt (`kvjax.experiments.verdicts.paired_gap`)."""
    return {(r["depth"], r["id"].rsplit("|", 1)[1]): float(r["correct"]) for r in records
            if r["policy"] == policy and r["length"] == length}


def accuracy_table(records: list[dict]) -> dict[int, dict[float, float]]:
    """{length: {depth: accuracy}}."""
    cells: dict[int, dict[float, list[bool]]] = {}
    for r in records:
        cells.setdefault(r["length"], {}).setdefault(r["depth"], []).append(r["correct"])
    return {n: {d: float(np.mean(v)) for d, v in sorted(row.items())} for n, row in sorted(cells.items())}


def held_table(records: list[dict]) -> dict[int, float | None]:
    """{length: mean `kv_held` of its records}, None where a record predates the field (`kvjax.experiments.held`)."""
    lengths: dict[int, list[dict]] = {}
    for r in records:
        lengths.setdefault(r["length"], []).append(r)
    return {n: mean_held(rs) for n, rs in sorted(lengths.items())}


def write_report(out: Path, tables: dict[str, dict], held: dict[str, dict] | None = None
                 ) -> tuple[str, dict, list[Path]]:
    """(markdown, JSON summary, figures) of the accuracy tables (`{label: accuracy_table}`) and the KV bytes each
    label's records held (`{label: held_table}`; a length missing, or None, is a blank cell); draws
    OUT/results.png. The summary is `{label: {length: {depth: accuracy}}}` plus `"kv_held": {label: {length:
    share or None}}`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    held = held or {}
    summary = {p: {str(n): {str(d): a for d, a in row.items()} for n, row in t.items()} for p, t in tables.items()}
    summary["kv_held"] = {p: {str(n): held.get(p, {}).get(n) for n in t} for p, t in tables.items()}
    lines = []
    for label, table in tables.items():
        depths = sorted({d for row in table.values() for d in row})
        lines += [f"### {label}", "",
                  "| length | " + " | ".join(f"depth {d:g}" for d in depths) + " | mean | KV held |",
                  "|---|" + "---|" * (len(depths) + 2)]
        for n, row in table.items():
            cells = [f"{100 * row[d]:.0f}" if d in row else "" for d in depths]
            lines.append(f"| {n} | " + " | ".join(cells) + f" | {100 * np.mean(list(row.values())):.1f} | "
                         f"{shown_held(held.get(label, {}).get(n))} |")
        lines.append("")
    if tables:
        lines += [("KV held: the share of the full cache's KV bytes the compressed prompt really holds (mean over the "
                   "length's samples; blank where a record predates the measurement)."), ""]
    fig, axes = plt.subplots(1, len(tables), figsize=(4 * len(tables), 3), squeeze=False)
    for ax, (label, table) in zip(axes[0], tables.items()):
        depths = sorted({d for row in table.values() for d in row})
        grid = np.array([[row.get(d, np.nan) for d in depths] for row in table.values()])
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_yticks(range(len(table)), list(table))
        ax.set_xlabel("depth")
        ax.set_ylabel("length")
        ax.set_title(label, fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "results.png", dpi=100)
    plt.close(fig)
    return "\n".join(lines), summary, [out / "results.png"]


def suite(lm, policies, out, *, lengths: list[int] | None = None, depths=(0.0, 0.25, 0.5, 0.75, 1.0),
          samples: int = 5, batch: int = 8, seed: int = 0, protocol: str = "aware", progress: bool = True,
          chat: bool = False) -> driver.SuiteResult:
    """Passkey accuracy of each policy (`{label: policy}`, a list or one) per length and depth, into
    `out`. `lengths` default to max/4, max/2 and max - 8 (those the prompt fits in). The table holds
    every policy recorded in `out`, so runs of one policy at a time add up to one table; its summary is
    `{policy description: {length: {depth: accuracy}}}`, plus `"kv_held": {policy description: {length: the
    mean share of the full cache's KV bytes held, None for records from before the field}}`."""
    driver.positive(samples, "samples")
    driver.positive(batch, "batch")
    tok, n = lm.tokenizer, lm.model.cfg.max_position_embeddings  # the contract's: any model
    if not all(0 <= d <= 1 for d in depths):
        raise driver.ArgumentError(f"depths={list(depths)} must each be in [0, 1]")
    lengths = list(lengths or default_lengths(tok, n, chat))
    too_long = [L for L in lengths if L + MAX_NEW_TOKENS > n]
    if too_long:
        raise driver.ArgumentError(f"lengths={too_long} + {MAX_NEW_TOKENS} generated tokens exceed the model's "
                                   f"max_position_embeddings={n}")
    too_short = [L for L in lengths if L < min_length(tok, chat=chat)]
    if too_short:
        raise driver.ArgumentError(f"lengths={too_short} are shorter than the passkey prompt without garbage "
                                   f"({min_length(tok, chat=chat)} tokens with this tokenizer)")
    policies = driver.labelled(policies)

    def report(log):
        labels = dict.fromkeys(r["policy"] for r in log)
        tables = {pol: accuracy_table([r for r in log if r["policy"] == pol]) for pol in labels}
        held = {pol: held_table([r for r in log if r["policy"] == pol]) for pol in labels}
        return write_report(Path(out), tables, held)

    run = cells(lm.model, tok, {pol.describe(): pol for pol in policies.values()}, lengths, list(depths), samples,
                seed=seed, batch=batch, protocol=protocol, report=report, chat=chat)
    # the chat template joins the identity only when on: runs in raw text keep the identity they always had
    options = {"seed": seed, "batch": batch, "protocol": protocol} | ({"chat_template": "on"} if chat else {})
    return driver.run_suite(run, out, lm, options, policies, progress=progress)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.passkey", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", help=model_help("the embedded default model"))
    p.add_argument("--lengths", type=int_list, help="prompt lengths in tokens (default: max/4, max/2, max - 8, "
                                                "those the prompt fits in)")
    p.add_argument("--depths", type=float_list, default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="needle depths in [0, 1], comma-separated")
    p.add_argument("--samples", type=positive_int, default=5, help="samples per (length, depth)")
    p.add_argument("--batch", type=positive_int, default=8, help="prompts generated together (of one length)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="the random seed of the five-digit pass keys")
    p.add_argument("--out", default="results/passkey",
                   help="where the results go (a folder; a rerun with the same options resumes there)")
    add_chat_template_arg(p, default="off", help="the tokenizer's chat template around each prompt (the description, "
                          "garbage and needle in the user turn; the question, the end of the turn and the assistant "
                          "header, then 'The pass key is'): off (raw text, the papers' protocol and the default), on, "
                          "or auto (on iff the tokenizer has one)")
    add_protocol_arg(p)
    add_compare_args(p, default="full")
    add_run_args(p)
    args = p.parse_args(argv)

    lm = suite_model(args)
    chat = chat_template_on(lm.tokenizer, args.chat_template)  # on without a template: refused
    hint_raw(lm.tokenizer, chat, "passkey")
    policies = list(compared(p, args, lm.config.num_layers, lm.path).values())
    res = driver.call(p, suite, lm, policies, args.out, lengths=args.lengths, depths=args.depths,
                      samples=args.samples, batch=args.batch, seed=args.seed, protocol=args.protocol, chat=chat)
    print(res.table)
    for policy in policies:
        records = [r for r in ResultLog(res.out / "samples.jsonl") if r["policy"] == policy.describe()]
        print(f"{policy.describe()}: {100 * np.mean([r['correct'] for r in records]):.1f} % over {len(records)} "
              f"samples")
    print(f"wrote {res.out}/results.{{md,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
