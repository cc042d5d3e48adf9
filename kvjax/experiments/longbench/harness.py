"""LongBench v1 under a cache policy, following the official `pred.py` / `eval.py`.

Per sample: the dataset's prompt template (`config.json`), middle truncation to `max_length`
tokens done as the official code does (token ids cut to the first and last half, each half
decoded, the text re-tokenised), the chat template unless the dataset is on the no-chat list
(and only if the tokenizer has one), greedy decoding of the dataset's max new tokens (samsum
also stops at a newline), the prediction decoded without special tokens. Scores follow
`metrics.py`. Predictions are appended to OUT/preds/<policy>/<dataset>.jsonl as they finish,
so an interrupted run resumes; results go to OUT/result.json, results.{md,csv,json,png}. Each
prediction's `kv_held` is the share of the full cache's KV bytes its compressed prompt really held.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kvjax.progress import bar as progress_bar

from kvjax.experiments.held import kv_held, mean_held
from kvjax.experiments.longbench import metrics
from kvjax.experiments.records import ResultLog
from kvjax import Sampling, generate_many
from kvjax.errors import InvalidInput, MissingFile

CONFIG_FILE = Path(__file__).resolve().parent / "config.json"
REQUIRED = ("input", "context", "answers", "length")


@lru_cache(maxsize=None)
def config() -> dict:
    return json.loads(CONFIG_FILE.read_text())


def dataset_names(data_dir: Path, e: bool = False) -> list[str]:
    """The datasets of `data_dir` (its *.jsonl files; `_e` files for LongBench-E)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise MissingFile(f"--data-dir {data_dir} is not a directory")
    stems = sorted(p.stem for p in data_dir.glob("*.jsonl"))
    if not stems:
        raise MissingFile(f"--data-dir {data_dir} has no .jsonl files")
    if e:
        names = [s[:-2] for s in stems if s.endswith("_e")]
        if not names:
            raise MissingFile(f"--e: --data-dir {data_dir} has no LongBench-E files (<dataset>_e.jsonl)")
        return names
    return [s for s in stems if not s.endswith("_e")]


def check_dataset(name: str) -> None:
    if name not in config()["prompts"]:
        raise InvalidInput(f"unknown dataset {name!r}: kvjax has no prompt for it; known datasets: "
                         f"{sorted(config()['prompts'])}")


def load_rows(data_dir: Path, name: str, e: bool = False) -> list[dict]:
    """A dataset's rows, each checked for the LongBench fields (the bad row is named)."""
    check_dataset(name)
    path = Path(data_dir) / f"{name}{'_e' if e else ''}.jsonl"
    if not path.is_file():
        raise MissingFile(f"dataset {name!r}: {path} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:  # LongBench's files are UTF-8 JSON lines; name the line a converter broke
        line = raw[:err.start].count(b"\n") + 1
        raise InvalidInput(f"{path}:{line}: not UTF-8 text ({err.reason}, byte 0x{raw[err.start]:02x} at offset "
                           f"{err.start})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise InvalidInput(f"{path}:{n}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise InvalidInput(f"{path}:{n}: a JSON {type(row).__name__}, not a LongBench row (an object)")
        missing = [f for f in REQUIRED if f not in row]
        if missing:
            raise InvalidInput(f"{path}:{n}: row is missing field {missing[0]!r} (a LongBench row has {list(REQUIRED)}, "
                             "plus all_classes and _id)")
        if not isinstance(row["answers"], list) or not row["answers"]:
            raise InvalidInput(f"{path}:{n}: 'answers' must be a non-empty list, got {row['answers']!r}")
        row.setdefault("all_classes", None)
        row.setdefault("_id", f"{name}-{n}")
        rows.append(row)
    if not rows:
        raise InvalidInput(f"{path} has no rows")
    return rows


def truncate_middle_text(tok, prompt: str, max_length: int) -> str:
    """pred.py's truncation: the first and last `max_length // 2` tokens, decoded and joined."""
    ids = tok(prompt, truncation=False)["input_ids"]
    if len(ids) <= max_length:
        return prompt
    half = int(max_length / 2)
    return tok.decode(ids[:half], skip_special_tokens=True) + tok.decode(ids[-half:], skip_special_tokens=True)


def build_prompt(tok, dataset: str, row: dict, max_length: int, chat: bool) -> str:
    prompt = config()["prompts"][dataset].format(**row)
    prompt = truncate_middle_text(tok, prompt, max_length)
    if chat and dataset not in config()["no_chat_template"] and getattr(tok, "chat_template", None):
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return prompt


def split_prompt(tok, dataset: str, row: dict, prompt: str) -> tuple[list[int], list[int]]:
    """(context ids, question ids) of a built prompt for the question-agnostic protocol: the question is
    what the dataset's template puts after `{context}` (with the chat template's closing, if any),
    found at the end of the prompt, which middle truncation never cuts."""
    template = config()["prompts"][dataset]
    question = template[template.index("{context}") + len("{context}"):].format(**row)
    at = prompt.rfind(question)
    if at < 0 or not question.strip():
        raise InvalidInput(f"{dataset}: the question after {{context}} was not found at the end of the prompt; "
                           "use --protocol aware for this dataset")
    return tok(prompt[:at], truncation=False)["input_ids"], tok(prompt[at:], add_special_tokens=False)["input_ids"]


def policy_slug(policy) -> str:
    """A directory name for a policy: its class, budget and a hash of its full description."""
    desc = policy.describe()
    budget = getattr(policy, "budget", None)
    name = re.sub(r"[^A-Za-z0-9]+", "", type(policy).__name__)
    return f"{name}{'-' + str(budget) if budget is not None else ''}-{hashlib.sha1(desc.encode()).hexdigest()[:6]}"


@dataclass
class Options:
    max_length: int | None = None  # default: the model's max_position_embeddings - the dataset's max new tokens
    batch: int = 8
    samples: int | None = None  # first N rows of each dataset
    chat: bool = True
    e: bool = False
    protocol: str = "aware"  # or "agnostic": the context compressed without the question (kvpress's protocol)


def predict(lm, policy, data_dir: Path, dataset: str, out: Path, opts: Options, progress: bool = True) -> list[dict]:
    """Predictions for every row not yet in OUT/preds/<policy>/<dataset>.jsonl; returns all of them."""
    return predict_many(lm, [policy], data_dir, dataset, out, opts, progress)[0]


def predict_many(lm, policies, data_dir: Path, dataset: str, out: Path, opts: Options,
                 progress: bool = True) -> list[list[dict]]:
    """`predict` for several policies at once (each keeps its own OUT/preds/<policy>/ log): per batch of rows,
    the policies still missing a prediction run together (`generate_many`: those whose prompt is one plain
    pass share it). Returns each policy's predictions, in order."""
    tok, cfg = lm.tokenizer, config()
    if opts.samples is not None and (isinstance(opts.samples, bool) or not isinstance(opts.samples, int)
                                     or opts.samples < 1):
        # rows[:-1] would silently drop the last sample
        raise InvalidInput(f"samples={opts.samples!r} must be a positive integer (or None: every sample)")
    rows = load_rows(data_dir, dataset, opts.e)[: opts.samples]
    max_new = cfg["max_new_tokens"][dataset]
    max_length = opts.max_length or lm.model.cfg.max_position_embeddings - max_new
    logs = [ResultLog(out / "preds" / policy_slug(p) / f"{dataset}{'_e' if opts.e else ''}.jsonl", key="_id")
            for p in policies]
    todo = [r for r in rows if any(r["_id"] not in log for log in logs)]
    eos = list(lm.model.cfg.eos_token_ids)
    if dataset in cfg["stop_at_newline"]:
        eos.append(tok.encode("\n", add_special_tokens=False)[-1])
    total = len(rows) * len(policies)
    bar = progress_bar(total=total, initial=sum(r["_id"] in log for log in logs for r in rows), desc=dataset,
                       disable=not progress, nested=True)
    for s in range(0, len(todo), opts.batch):
        chunk = todo[s : s + opts.batch]
        wanted = [i for i, log in enumerate(logs) if any(r["_id"] not in log for r in chunk)]
        texts = [build_prompt(tok, dataset, r, max_length, opts.chat) for r in chunk]
        if opts.protocol == "agnostic":
            parts = [split_prompt(tok, dataset, r, t) for r, t in zip(chunk, texts)]
            prompts, questions = [c + q for c, q in parts], [q for _, q in parts]
            contexts = [c for c, _ in parts]
        else:  # today's ids: the whole prompt tokenised at once
            prompts, questions = [tok(t, truncation=False)["input_ids"] for t in texts], None
            contexts = prompts
        gens = generate_many(lm.model, contexts, [policies[i] for i in wanted], questions=questions,
                             max_new_tokens=max_new, sampling=Sampling(), eos_ids=eos, pad_id=tok.pad_token_id,
                             truncate=True, keep_caches=False, pad_rows=opts.batch)
        for i, gen in zip(wanted, gens):
            for r, p, seq, held in zip(chunk, prompts, gen.sequences(), gen.held_fraction):
                if r["_id"] in logs[i]:
                    continue
                logs[i].add({"_id": r["_id"], "pred": tok.decode(seq, skip_special_tokens=True),
                             "answers": r["answers"], "all_classes": r["all_classes"], "length": r["length"],
                             "prompt_tokens": len(p), "kv_held": kv_held(held)})
                bar.update(1)
    bar.close()
    ids = {r["_id"] for r in rows}
    return [[r for r in log if r["_id"] in ids] for log in logs]


def score_dataset(dataset: str, preds: list[dict], e: bool = False) -> dict:
    """The dataset's score as eval.py computes it, and the mean share of the full cache's KV bytes its predictions'
    prompts held (`kv_held`; None if a prediction predates the field)."""
    metric = config()["metrics"][dataset]
    scores = [metrics.sample_score(dataset, metric, p["pred"], p["answers"], p["all_classes"]) for p in preds]
    out = {"metric": metric, "score": metrics.score(scores), "samples": len(scores), "kv_held": mean_held(preds)}
    if e:
        out["buckets"] = metrics.score_e(scores, [p["length"] for p in preds])
    return out
