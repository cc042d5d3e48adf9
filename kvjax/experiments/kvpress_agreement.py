"""kvpress beside kvjax on the same RULER prompts: kvpress 0.5.5's own pipeline answers the prompts of a committed
kvjax RULER run, and each answer is compared with kvjax's, sample by sample.

    python -m kvjax.experiments.kvpress_agreement --records docs/report-smollm2/runs/ruler-chat --model smollm2 \\
        --methods full,streaming,snapkv-kvpress,knorm,tova --ratios 0.5,0.875 --tasks niah_single_1 --out OUT

kvpress runs as a researcher runs it: transformers loads the same GGUF file (`from_pretrained(gguf_file=...)`,
dequantized to float32), and `KVPressTextGenerationPipeline` takes each sample's context, question and answer prefix
with the press, greedy, the task's `tokens_to_generate` new tokens at most. Before a sample is run, the pipeline's
own prompt ids (`preprocess`) are checked equal to the ids kvjax built for it (`kvjax.experiments.common.prompt_ids`, in
the run's chat-template mode): a comparison of answers to different prompts would say nothing.

Each kvjax method (a label of the report's RULER section) maps to the press kvpress implements it with, at kvjax's
settings (`PRESSES`): SnapKV at kvpress's own settings (window 64, kernel 5, average pooling: `snapkv-kvpress`),
AdaKV around a SnapKVPress with kvjax's window 32 and kernel 7 (kvpress's SnapKV pools by average, kvjax's `adakv`
by maximum: a difference the table states) and at kvpress's own settings (`adakv-kvpress`, matched), DuoAttention
with the head scores of the run's `duo.json` (kvpress would download a pattern; here its loader is handed kvjax's
scores, so both prune the same heads), KVzip with the model's chat template for its replay (kvpress reads the
tokenizer by name from a hub; here it is handed the pipeline's).

Records: OUT/answers.jsonl (one per method, ratio, task and sample: both answers, both scores, whether they agree,
the seconds of kvpress's pipeline call; appended and fsynced, so a killed run resumes), OUT/agreement.{md,json}. Needs the test extra (torch, transformers,
kvpress); reads no network.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

from kvjax.progress import Bar as progress_bar

from kvjax.experiments import cli, driver
from kvjax.experiments.common import float_list, model_help, positive_int, prompt_ids
from kvjax.experiments.records import content_fingerprint, model_fingerprint, read_json, write_atomic
from kvjax.experiments.ruler import compare, scoring
from kvjax.experiments.ruler import tasks as T
from kvjax.errors import InvalidInput, MissingFile
from kvjax.cli import HelpFormatter

# kvjax's label -> (what kvpress runs, the settings that match kvjax's policy; a setting that does not, said)
SETTINGS = {
    "full": "no press",
    "streaming": "StreamingLLMPress(n_sink=4): its window is kept from the prompt and the question and answer "
                 "appended, kvjax's streaming slides it",
    "streaming-kvpress": "StreamingLLMPress(n_sink=4): as kvjax's streaming-kvpress, the window chosen once from the "
                         "prompt",
    "snapkv-kvpress": "SnapKVPress(window_size=64, kernel_size=5): average pooling, as kvjax's snapkv-kvpress",
    "knorm": "KnormPress",
    "tova": "TOVAPress",
    "keydiff": "KeyDiffPress",
    "expected-attention": "ExpectedAttentionPress(n_future_positions=512, n_sink=4, use_covariance, use_vnorm, "
                          "epsilon=0)",
    "adakv": "AdaKVPress(SnapKVPress(window_size=32, kernel_size=7), alpha_safeguard=0.2): kvpress's SnapKV pools by "
             "average, kvjax's adakv by maximum",
    "adakv-kvpress": "AdaKVPress(SnapKVPress(window_size=64, kernel_size=5), alpha_safeguard=0.2): average pooling, "
                     "as kvjax's adakv-kvpress",
    "duo": "DuoAttentionPress(head_compression_ratio=r), the run's duo.json head scores, 128 sinks, 256 recent: its "
           "streaming heads keep the prompt's window and append the question and answer, kvjax's duo slides them",
    "duo-kvpress": "DuoAttentionPress(head_compression_ratio=r), the run's duo.json head scores, 128 sinks, 256 "
                   "recent: as kvjax's duo-kvpress, the streaming heads' window chosen once from the prompt",
    "kvzip": "KVzipPress(chunk_size=2048, n_sink=4), the replay in the model's chat template",
}


def make_press(name: str, ratio: float | None):
    """kvpress's press for kvjax's method `name` at `ratio` (None: the full cache)."""
    import kvpress

    if name == "full":
        return None
    if name in ("streaming", "streaming-kvpress"):
        return kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=4)
    if name == "snapkv-kvpress":
        return kvpress.SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5)
    if name == "knorm":
        return kvpress.KnormPress(compression_ratio=ratio)
    if name == "tova":
        return kvpress.TOVAPress(compression_ratio=ratio)
    if name == "keydiff":
        return kvpress.KeyDiffPress(compression_ratio=ratio)
    if name == "expected-attention":
        return kvpress.ExpectedAttentionPress(compression_ratio=ratio, n_future_positions=512, n_sink=4,
                                              use_covariance=True, use_vnorm=True, epsilon=0.0)
    if name == "adakv":
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7),
                                  alpha_safeguard=0.2)
    if name == "adakv-kvpress":
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5),
                                  alpha_safeguard=0.2)
    if name in ("duo", "duo-kvpress"):
        return kvpress.DuoAttentionPress(head_compression_ratio=ratio)
    if name == "kvzip":
        return kvpress.KVzipPress(compression_ratio=ratio, chunk_size=2048, n_sink=4)
    raise AssertionError(f"make_press: {name!r} is in SETTINGS but has no press")


@contextlib.contextmanager
def offline_presses(tokenizer, duo: dict | None):
    """kvpress's presses that would read a hub, handed what kvjax's run used instead: DuoAttention's head pattern
    (sinks, recent window, scores per layer and KV head) and KVzip's tokenizer (the pipeline's own)."""
    import numpy as np
    from kvpress.presses import duo_attention_press, kvzip_press

    saved = duo_attention_press.DuoAttentionPress.load_attention_pattern, kvzip_press.AutoTokenizer.from_pretrained
    if duo is not None:
        pattern = (duo["sink_size"], duo["recent_size"], np.asarray(duo["duo_scores"], dtype=float))
        duo_attention_press.DuoAttentionPress.load_attention_pattern = staticmethod(lambda model: pattern)
    kvzip_press.AutoTokenizer.from_pretrained = lambda *a, **k: tokenizer
    try:
        yield
    finally:
        duo_attention_press.DuoAttentionPress.load_attention_pattern = saved[0]
        kvzip_press.AutoTokenizer.from_pretrained = saved[1]


def read_run(records: Path) -> tuple[dict, list[dict], dict]:
    """(identity, kvjax's records, the duo.json beside them or None) of a committed RULER run."""
    for name in ("identity.json", "preds.jsonl"):
        if not (records / name).is_file():
            raise MissingFile(f"{records / name}: not a kvjax RULER run (no {name})")
    identity = read_json(records / "identity.json")
    duo = read_json(records / "duo.json") if (records / "duo.json").is_file() else None
    return identity, compare.read(records), duo


def samples_of(records: Path, task: str, length: int) -> list[dict]:
    path = records / "data" / f"{task}-{length}.jsonl"
    if not path.is_file():
        raise MissingFile(f"{path}: the run's samples of {task} at {length} are not there")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(rows: list[dict], methods: list[str], ratios: list[float]) -> tuple[str, dict]:
    """Per method and ratio: samples where kvpress gives kvjax's answer (the same text), and each side's score; with
    the seconds of kvpress's pipeline calls (median, min–max) where the answers were timed (answers logged before
    the calls were timed have none, and a table of only those has no such column)."""
    timed_any = any("kvpress_seconds" in r for r in rows)
    lines = ["| method | ratio | samples | same answer | kvjax found | kvpress found | "
             + ("kvpress s an answer | " if timed_any else "") + "kvpress as |",
             "|---|---|---|---|---|---|---|" + ("---|" if timed_any else "")]
    summary = {}
    for name in methods:
        for ratio in ([None] if name == "full" else ratios):
            mine = [r for r in rows if r["method"] == name and r["ratio"] == ratio]
            if not mine:
                continue
            same = sum(r["same"] for r in mine)
            found = (sum(r["kvjax_score"] for r in mine), sum(r["kvpress_score"] for r in mine))
            key = name if ratio is None else f"{name}@{ratio}"
            summary[key] = {"samples": len(mine), "same": same, "kvjax_found": found[0], "kvpress_found": found[1]}
            cells = [name, "" if ratio is None else ratio, len(mine), same, f"{found[0]:g}", f"{found[1]:g}"]
            if timed_any:
                timed = [r["kvpress_seconds"] for r in mine if "kvpress_seconds" in r]
                seconds = (statistics.median(timed), min(timed), max(timed)) if timed else None
                summary[key]["kvpress_seconds"] = seconds
                cells.append("" if seconds is None else "{:.2f} ({:.2f}–{:.2f})".format(*seconds))
            lines.append("| " + " | ".join(map(str, cells + [SETTINGS[name]])) + " |")
    differ = [r for r in rows if not r["same"]]
    if differ:
        lines += ["", "Where the answers differ:", "", "| method | ratio | task | sample | kvjax | kvpress |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['ratio'] or ''} | {r['task']} | {r['index']} | {r['kvjax']!r} | "
                  f"{r['kvpress']!r} |" for r in differ]
    return "\n".join(lines), summary


def check_same_model(records: Path, identity: dict, lm) -> None:
    """Refuses to compare kvpress on `lm` with a run of another model: the run's weights digest (of the arrays, or of
    the model file for runs recorded before `kvjax.experiments.identity`) and dtype must be `lm`'s."""
    from kvjax.experiments.identity import model_identity

    ours = model_identity(lm.model)["weights"] if "model class" in identity else model_fingerprint(lm.path)
    dtype = str(getattr(lm.model, "dtype", ""))
    if (identity.get("weights"), identity.get("model dtype")) != (ours, dtype):
        raise InvalidInput(f"--model {lm.path}: its weights ({ours}, {dtype}) are not those of the run in {records} "
                           f"({identity.get('weights')}, {identity.get('model dtype')}); kvpress would answer for "
                           "another model than kvjax's records")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.kvpress_agreement", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--records", required=True, help="a kvjax RULER run directory (identity.json, preds.jsonl, data/)")
    p.add_argument("--model", required=True, help=model_help() + "; the run's model (transformers reads its .gguf file)")
    p.add_argument("--methods", default="full,streaming,snapkv-kvpress,knorm,tova",
                   help=f"kvjax labels, comma-separated (known: {', '.join(SETTINGS)})")
    p.add_argument("--ratios", type=float_list, default=[0.5, 0.875],
                   help="the run's compression ratios to compare, comma-separated (kvpress's compression_ratio)")
    p.add_argument("--tasks", default="niah_single_1", help="comma-separated RULER tasks of the run")
    p.add_argument("--samples", type=positive_int, default=10, help="the first N samples of each task")
    p.add_argument("--out", required=True, help="where the answers and the table go (a folder; a rerun resumes there)")
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    for name in methods:
        if name not in SETTINGS:
            raise InvalidInput(f"--methods: {name!r} has no kvpress press here (known: {', '.join(SETTINGS)})")
    records = Path(args.records)
    identity, kvjax_rows, duo = read_run(records)
    if {"duo", "duo-kvpress"} & set(methods) and duo is None:
        raise MissingFile(f"{records / 'duo.json'}: --methods {','.join(m for m in methods if m.startswith('duo'))} "
                          "needs the run's head scores")
    length = {r["length"] for r in kvjax_rows}
    if len(length) != 1:
        raise InvalidInput(f"{records}: records at several lengths ({sorted(length)}); one is compared at a time")
    length = length.pop()
    theirs = {(r["label"], r["task"], r["index"]): r for r in kvjax_rows}

    import torch
    import transformers
    from kvpress.pipeline import KVPressTextGenerationPipeline
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()  # this run's own bar counts the answers

    lm = driver.load_model(args.model)
    gguf = Path(lm.path)
    if gguf.suffix != ".gguf":
        raise InvalidInput(f"--model {args.model}: kvpress reads the model through transformers' GGUF loading; "
                           f"{gguf} is not a GGUF file")
    check_same_model(records, identity, lm)
    chat = identity.get("--chat-template") == "on"
    # kvpress's answers depend on the prompts (the run's data/ files) and their format; kvjax's answers are copied
    # into each record, so kvjax records added to the run later (another method) change nothing here
    options = {"chat_template": chat, "seed": identity.get("--seed"), "protocol": identity.get("--protocol")}
    log = driver.open_records(args.out, lm, "answers.jsonl", options,
                              extra={"RULER prompts": content_fingerprint(records / "data")})
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not chat:
        tok.chat_template = None  # the run fed raw text; kvpress's pipeline then does too
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device="cpu")

    cells = []
    for task in args.tasks.split(","):
        if task not in T.TASKS:
            raise InvalidInput(f"--tasks: {task!r} is not a RULER task")
        gen = identity.get("--max-new-tokens") or T.TASKS[task].tokens_to_generate  # the run's, as its answers
        for sample in samples_of(records, task, length)[: args.samples]:
            for name in methods:
                for ratio in ([None] if name == "full" else args.ratios):
                    label = name if ratio is None else f"{name}@{ratio}"
                    if (label, task, sample["index"]) not in theirs:
                        raise MissingFile(f"{records}: kvjax has no record of {label} on {task} sample "
                                          f"{sample['index']}")
                    cells.append((name, ratio, label, task, gen, sample))
    with offline_presses(tok, duo), progress_bar(cells, desc="kvpress", unit="answer") as bar:
        for name, ratio, label, task, gen, sample in bar:
            key = f"{label}|{task}|{sample['index']}"
            if key in log:
                continue
            want = prompt_ids(lm.tokenizer, sample["context"], sample["question"], sample["answer_prefix"], on=chat)
            got = pipe.preprocess(sample["context"], [sample["question"]], sample["answer_prefix"],
                                  max_context_length=10**9)
            if (got["context_ids"][0].tolist(), got["questions_ids"][0][0].tolist()) != tuple(want):
                raise AssertionError(f"{task} sample {sample['index']}: kvpress's prompt ids differ from kvjax's")
            t0 = time.perf_counter()
            with torch.no_grad():
                answer = pipe(sample["context"], question=sample["question"], answer_prefix=sample["answer_prefix"],
                              press=make_press(name, ratio), max_new_tokens=gen)["answer"]
            seconds = time.perf_counter() - t0  # the pipeline's call: prompt pass, press, question and answer
            ours, pred = theirs[(label, task, sample["index"])], scoring.postprocess(answer)  # as kvjax's preds
            log.add({"id": key, "method": name, "ratio": ratio, "task": task, "index": sample["index"],
                     "kvjax": ours["pred"], "kvpress": pred, "same": ours["pred"] == pred,
                     "kvjax_score": ours["score"],
                     "kvpress_score": scoring.sample_score(pred, sample["outputs"], T.METRICS[T.TASKS[task].kind]),
                     "kvpress_seconds": round(seconds, 3)})
    # the table is of every answer in OUT (a resumed run may have added other methods, ratios or samples to it)
    rows = list(log)
    text, summary = table(rows, list(dict.fromkeys(r["method"] for r in rows)),
                          sorted({r["ratio"] for r in rows if r["ratio"] is not None}))
    out = Path(args.out)
    write_atomic(out / "agreement.md", f"# kvpress 0.5.5's pipeline beside kvjax, {records}\n\n{text}\n")
    write_atomic(out / "agreement.json", json.dumps(summary, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, compile_cache=None))
