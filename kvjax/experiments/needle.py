"""Needle in a haystack: a fact hidden at a depth of a long context, asked for at the end; a grid of
context lengths x depths per cache policy, scored without a judge model.

    python -m kvjax.experiments.needle [--model DIR] [--haystack DIR] [--lengths 128,256,504]
        [--depths 0,25,50,75,100] [--compare full,streaming,razor --heads heads.json] [--budget 128]

Insertion follows the original harness (gkamradt/LLMTest_NeedleInAHaystack): the haystack's tokens
are cut to the room left by the needle and the question, the insertion point is `depth %` of them,
and it moves back until the token before it ends a sentence; the needle's tokens go there. Prompts
are assembled from token ids, so every prompt has exactly the requested length. Scores: ROUGE-1
recall of the needle's words in the answer, and exact match (the answer contains the key fact).
Default haystack: the standard-library reference documentation; the default needle is a made-up
fact of the kind the default model was trained to retrieve. Results: OUT/cells.jsonl (resumable; each
record's `kv_held`, the share of the full cache's KV bytes the compressed prompt really held, is the tables'
"KV held" row), OUT/results.{json,md} and a heatmap per policy, OUT/heatmap_<policy>.png.
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
    positive_int,
    split_question,
    suite_model,
    utf8_text,
)
from kvjax.experiments.held import kv_held, mean_held, shown_held
from kvjax import Sampling, generate
from kvjax.errors import InvalidInput, MissingFile
from kvjax.cli import HelpFormatter

NEEDLE = " The founder of Kalomiven is Ravendor."
QUESTION = "\nQuestion: What is the founder of Kalomiven?\nAnswer:"
ANSWER = "Ravendor"
MAX_NEW_TOKENS = 12


def haystack_text(directory: str | None) -> str:
    if directory is None:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    files = sorted(Path(directory).glob("*.txt"))
    if not files:
        raise MissingFile(f"the haystack directory {directory} has no .txt files")
    return "\n\n".join(f.read_text() for f in files)


def _ends_sentence(tok, token_id: int) -> bool:
    return tok.convert_ids_to_tokens(int(token_id)).rstrip().endswith((".", "!", "?"))


def _frame(tok, question: str, chat: bool) -> tuple[list[int], list[int]]:
    """(the ids before the haystack, the question's ids): raw text, BOS and the question; with the chat template
    (`chat`), as kvpress's pipeline builds a prompt, the user turn's opening, and the question + the end of the turn
    + the assistant header."""
    if not chat:
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        return bos, tok(question, add_special_tokens=False)["input_ids"]
    head, suffix = chat_parts(tok, True)
    return (tok(head, add_special_tokens=False)["input_ids"],
            tok(question + suffix, add_special_tokens=False)["input_ids"])


def needle_prompt(tok, haystack_ids: list[int], length: int, depth: float, needle: str, question: str,
                  chat: bool = False) -> tuple[list[int], int]:
    """(prompt of exactly `length` tokens, index of the needle's first token) for `depth` in [0, 100]; `chat`: in
    the chat template."""
    if not 0 <= depth <= 100:
        raise InvalidInput(f"depth={depth} must be a percentage in [0, 100]")
    opening, q_ids = _frame(tok, question, chat)
    n_ids = tok(needle, add_special_tokens=False)["input_ids"]
    room = length - len(opening) - len(n_ids) - len(q_ids)
    if room < 1:
        raise InvalidInput(f"length={length} leaves no room for the haystack (needle + question take "
                         f"{length - room} tokens)")
    if len(haystack_ids) < room:
        raise InvalidInput(f"the haystack has {len(haystack_ids)} tokens; length={length} needs {room}")
    context = list(haystack_ids[:room])
    at = int(room * depth / 100)
    while at > 0 and not _ends_sentence(tok, context[at - 1]):  # back to a sentence boundary
        at -= 1
    return opening + context[:at] + n_ids + context[at:] + q_ids, len(opening) + at


def rouge1_recall(answer: str, reference: str) -> float:
    """Share of the reference's (lower-cased, alphanumeric) words, with multiplicity, found in the answer."""
    words = lambda s: re.findall(r"[a-z0-9]+", s.lower())  # noqa: E731
    ref, ans = words(reference), words(answer)
    if not ref:
        raise InvalidInput("the reference has no words")
    pool = {}
    for w in ans:
        pool[w] = pool.get(w, 0) + 1
    hit = 0
    for w in ref:
        if pool.get(w, 0) > 0:
            pool[w] -= 1
            hit += 1
    return hit / len(ref)


def exact_match(answer: str, key: str) -> bool:
    return key.strip().lower() in answer.lower()


def write_report(out: Path, records: list[dict], labels: list[str]) -> tuple[str, dict, list[Path]]:
    """(markdown, JSON summary, figures): exact match and ROUGE-1 per policy, a heatmap each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, lines, figures = {}, [], []
    out.mkdir(parents=True, exist_ok=True)
    for lab in labels:
        recs = [r for r in records if r["label"] == lab]
        if not recs:
            continue
        lengths = sorted({r["length"] for r in recs})
        depths = sorted({r["depth"] for r in recs})
        grid = {(r["length"], r["depth"]): r for r in recs}
        em = np.array([[grid[(n, d)]["exact"] if (n, d) in grid else np.nan for n in lengths] for d in depths], float)
        rouge = np.array([[grid[(n, d)]["rouge1_recall"] if (n, d) in grid else np.nan for n in lengths]
                          for d in depths])
        held = {n: mean_held([r for r in recs if r["length"] == n]) for n in lengths}
        summary[lab] = {"policy": recs[0]["policy"], "exact_match": float(np.nanmean(em)),
                        "rouge1_recall": float(np.nanmean(rouge)), "lengths": lengths, "depths": depths,
                        "exact_grid": em.tolist(), "rouge_grid": rouge.tolist(),
                        "kv_held": {str(n): v for n, v in held.items()}}
        lines += [f"### {lab}: exact match {100 * np.nanmean(em):.1f} %, ROUGE-1 recall {np.nanmean(rouge):.3f}", "",
                  ("exact match (1/0) per depth (rows) and context length (columns); KV held: the share of the full "
                   "cache's KV bytes the compressed prompt really holds (mean over the length's prompts; blank where "
                   "a record predates the measurement):"), "",
                  "| depth % | " + " | ".join(map(str, lengths)) + " |", "|---|" + "---|" * len(lengths)]
        for d, row in zip(depths, em):
            lines.append(f"| {d:g} | " + " | ".join(f"{v:.0f}" for v in row) + " |")
        lines.append("| KV held | " + " | ".join(shown_held(held[n]) for n in lengths) + " |")
        lines.append("")
        # The heatmap shows exact match of the key fact: a short correct answer ("Ravendor") has a low
        # ROUGE-1 recall of the whole needle sentence, so recall alone would paint right answers red.
        fig, ax = plt.subplots(figsize=(1.5 + 0.7 * len(lengths), 1 + 0.45 * len(depths)))
        im = ax.imshow(em, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), lengths)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set(xlabel="context length (tokens)", ylabel="needle depth (%)", title=lab)
        fig.colorbar(im, ax=ax, label="exact match")
        fig.tight_layout()
        figures.append(out / f"heatmap_{re.sub(r'[^A-Za-z0-9_-]+', '_', lab)}.png")
        fig.savefig(figures[-1], dpi=100)
        plt.close(fig)
    return "\n".join(lines), summary, figures


def suite(lm, policies, out, *, lengths: list[int] | None = None, depths=(0.0, 25.0, 50.0, 75.0, 100.0),
          haystack: str | None = None, needle: str = NEEDLE, question: str = QUESTION, answer: str = ANSWER,
          batch: int = 5, protocol: str = "aware", progress: bool = True, chat: bool = False) -> driver.SuiteResult:
    """Needle in a haystack for each policy (`{label: policy}`, a list or one) over lengths x depths
    (percentages), into `out`; summary `{label: {"exact_match", "rouge1_recall", grids, "kv_held": {length: the
    mean share of the full cache's KV bytes held, None for records from before the field}, ...}}`.
    `lengths` default to five up to the model's window; `haystack` is a directory of .txt files
    (default: the standard-library reference documentation)."""
    tok, n = lm.tokenizer, lm.model.cfg.max_position_embeddings
    top = n - MAX_NEW_TOKENS
    lengths = list(lengths or sorted({int(top * f) for f in (0.25, 0.4, 0.55, 0.75, 1.0)}))
    if not all(0 <= d <= 100 for d in depths):
        raise driver.ArgumentError(f"depths={list(depths)} must each be a percentage in [0, 100]")
    hay = tok(haystack_text(haystack), add_special_tokens=False)["input_ids"]
    policies = driver.labelled(policies)
    setting = f"{needle}|{question}"
    q_ids = _frame(tok, question, chat)[1]  # needle_prompt's question tokens
    rid = lambda cell: f"{policies[cell[0]].describe()}|{setting}|{cell[1]}|{cell[2]}"  # (label, L, d)

    def run(chunk: list) -> list[dict]:
        lab, L = chunk[0][:2]
        pol = policies[lab]
        prompts = [needle_prompt(tok, hay, L, d, needle, question, chat) for _, _, d in chunk]
        contexts, questions = split_question([pr for pr, _ in prompts], [len(q_ids)] * len(prompts), protocol)
        gen = generate(lm.model, contexts, pol, questions=questions, max_new_tokens=MAX_NEW_TOKENS, sampling=Sampling())
        records = []
        for cell, (_, at), seq, held in zip(chunk, prompts, gen.sequences(), gen.held_fraction):
            text = tok.decode(seq, skip_special_tokens=True).split("\n")[0]
            records.append({"id": rid(cell), "label": lab, "policy": pol.describe(), "length": L, "depth": cell[2],
                            "needle_at": at, "answer": text, "rouge1_recall": rouge1_recall(text, needle),
                            "exact": exact_match(text, answer), "kv_held": kv_held(held)})
        return records

    cells = [(lab, L, d) for lab in policies for L in lengths for d in depths]
    wanted = {rid(cell): cell[0] for cell in cells}

    def report(log):
        records = [r | {"label": wanted[r["id"]]} for r in log if r["id"] in wanted]
        return write_report(Path(out), records, list(policies))

    suite = driver.Suite("needle", "cells.jsonl", cells, rid, run, report,
                         lambda todo: driver.batches(todo, batch, group=lambda cell: cell[:2]))
    return driver.run_suite(suite, out, lm, {"haystack": haystack, "needle": needle, "question": question,
                                             "answer": answer, "batch": batch, "protocol": protocol}
                            | ({"chat_template": "on"} if chat else {}), policies,  # on only: raw runs keep theirs
                            progress=progress, files=("haystack",))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.needle", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", help=model_help("the embedded default model"))
    p.add_argument("--haystack", help="directory of .txt files (default: Python's reference documentation)")
    p.add_argument("--needle", type=utf8_text, default=NEEDLE, help="the fact hidden in the haystack")
    p.add_argument("--question", type=utf8_text, default=QUESTION, help="appended after the context")
    p.add_argument("--answer", default=ANSWER, help="the needle's key fact, for exact match")
    p.add_argument("--lengths", type=int_list, help="comma-separated prompt lengths (default: 5 up to the model's "
                                                    "window)")
    p.add_argument("--depths", type=float_list, default=[0.0, 25.0, 50.0, 75.0, 100.0],
                   help="comma-separated percentages")
    p.add_argument("--batch", type=positive_int, default=5, help="prompts generated together (depths of one length)")
    p.add_argument("--out", default="results/needle",
                   help="where the results go (a folder; a rerun with the same options resumes there)")
    add_chat_template_arg(p, default="off", help="the tokenizer's chat template around each prompt (the haystack in "
                          "the user turn; the question, the end of the turn and the assistant header after it): off "
                          "(raw text, the default), on, or auto (on iff the tokenizer has one)")
    add_protocol_arg(p)
    add_compare_args(p, default="full,streaming")
    add_run_args(p)
    args = p.parse_args(argv)

    lm = suite_model(args)
    chat = chat_template_on(lm.tokenizer, args.chat_template)  # on without a template: refused
    hint_raw(lm.tokenizer, chat, "needle")
    res = driver.call(p, suite, lm, compared(p, args, lm.config.num_layers, lm.path), args.out, lengths=args.lengths,
                      depths=args.depths, haystack=args.haystack, needle=args.needle, question=args.question,
                      answer=args.answer, batch=args.batch, protocol=args.protocol, chat=chat)
    print(res.table)
    print(f"wrote {res.out}/results.{{md,json}} and heatmap_*.png")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
