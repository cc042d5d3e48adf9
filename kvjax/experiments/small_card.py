"""kvjax-small's card: its targets measured on the trained model.

    python -m kvjax.experiments.small_card [--model kvjax/models/small] [--samples 4]

Measures held-out loss at the full context, passkey with the full cache at three lengths and with
StreamingLLM(256) whose window excludes the key, RULER's niah_single_1 at 2048 tokens, every dataset
of the LongBench-format suite sized for the context (`kvjax/experiments/longbench/data_small`) with the
full cache, the attention-sink share of the first token per layer, and which KV heads RazorAttention's
probe ranks as retrieval heads (written to MODEL/heads.json for the suites' `--heads`). Writes
README.md (the card) and eval.json next to the weights. `kvjax.experiments.train_small` calls it. It also runs
in a clone, which has the weights and the card but not the training folder (git ignores it): the run's
record and the training loss at the end come from the last card's eval.json, and the corpus is
tokenised again (cached in MODEL/training/data.npz) after checking it is the one the model was trained on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from kvjax.experiments import cli, corpus, passkey
from kvjax.experiments.common import model_help, positive_int
from kvjax.experiments.longbench.suite import SMALL_DATA_DIR
from kvjax.experiments.model_card import heldout_loss, sink_shares, sink_table
from kvjax.experiments.records import ResultLog, dumps_finite, model_fingerprint, write_atomic
from kvjax.experiments.tasks import (
    EXTEND_MIXTURE,
    MARKER_KINDS,
    TITLE_COUNT,
    TITLE_QUERIES,
    mixture,
    mixture_text,
)
from kvjax.experiments.train_tiny import tokenize_corpus
from kvjax.errors import InvalidInput, MissingFile, NonFiniteError
from kvjax.models import SMALL_DIR
from kvjax.models.loading import load_tokenizer
from kvjax.cli import HelpFormatter

STREAMING_BUDGET = 256  # the main job's budget: 8x compression of the 2048-token context


def evaluate(lm, data: dict[str, np.ndarray], work: Path, *, samples: int = 4) -> dict:
    from kvjax.experiments import find_heads
    from kvjax.experiments.longbench import __main__ as longbench
    from kvjax.experiments.ruler import __main__ as ruler
    from kvjax.policies import FullCache, StreamingLLM

    model, tok, n = lm.model, lm.tokenizer, lm.config.max_position_embeddings
    ev = {"heldout_loss": {name: heldout_loss(model, data[f"{name}_heldout"], n, 4, tok.bos_token_id)
                           for name in ("code", "docs")}}
    log = ResultLog(work / "passkey.jsonl")
    lengths = [n // 4, n // 2, n - passkey.MAX_NEW_TOKENS]
    full = passkey.run(model, tok, FullCache(), lengths, [0.0, 0.25, 0.5, 0.75, 1.0], samples, log, label="full")
    stream = StreamingLLM(budget=STREAMING_BUDGET, sinks=4)
    st = passkey.run(model, tok, stream, [lengths[-1]], [0.0, 0.25, 0.5], samples, log, label="streaming")
    ev["passkey"] = {
        "full": {str(k): float(np.mean(list(v.values()))) for k, v in passkey.accuracy_table(full).items()},
        "streaming": float(np.mean([r["correct"] for r in st])),
        "streaming_policy": stream.describe(),
        "streaming_key_outside_window": all(r["needle_at"] + 20 < r["length"] - (STREAMING_BUDGET - 4) for r in st),
        "samples_per_cell": samples,
    }
    r = ruler.suite(lm, {"full": FullCache()}, work / "ruler", lengths=[n], tasks=["niah_single_1"],
                    samples=5 * samples).summary
    ev["ruler_niah_single_1"] = {"length": n, "score": r["scores"]["full"]["niah_single_1"][str(n)],
                                 "samples": 5 * samples}
    lb = longbench.suite(lm, {"full": FullCache()}, work / "longbench", data_dir=str(SMALL_DATA_DIR),
                         samples=5 * samples)
    ev["longbench_full"] = {d: row["full"] for d, row in lb.summary["table"].items()}
    rows = np.stack([np.concatenate([[tok.bos_token_id], data["docs_heldout"][s : s + n - 1]])
                     for s in (0, len(data["docs_heldout"]) // 2)]).astype(np.int32)
    ev["sink"] = sink_shares(model, rows)
    heads = Path(lm.path) / "heads.json"
    table = np.asarray(find_heads.find(lm, heads, k=n // 8, repeats=4)[0]["retrieval_kv_heads"]).tolist()
    ev["retrieval_heads"] = {"kv_heads": table, "count": int(sum(map(sum, table))),
                             "of": len(table) * len(table[0])}
    return ev


CARD = """# kvjax-small: the embedded model for long-context comparisons

A {params:.2f} M-parameter Llama (GQA, RoPE) made **by kvjax** from its embedded default
(`kvjax/models/default`): grown from {init_layers} to {layers} layers by block expansion and taught a
{ctx}-token context on the Python standard library and synthetic tasks, so that cache policies at
budgets of 128-512 tokens compress a real context 4-16x, on a model deep enough for per-layer methods
(MAT's shallow/deep split, PyramidKV's schedule, RazorAttention's head choice). A research fixture,
not a useful language model.

| | |
|---|---|
| architecture | Llama: {layers} layers, hidden {hidden}, {heads} query / {kv_heads} KV heads (head dim {head_dim}), SwiGLU {ffn}, RoPE theta {theta:.0f}, untied head |
| context | {ctx} tokens (`max_position_embeddings`) |
| tokenizer | the default model's: byte-level BPE, {vocab} tokens, digits split one by one |
| initialisation | `kvjax/models/default` (2 layers, 512 tokens) grown by block expansion (`kvjax.models.grow`, LLaMA Pro): each layer followed by copies whose output projections are zero, so training starts from the default's function; RoPE base raised NTK-aware from 10000 to {theta:.0f} for {ctx} / 512 = {stretch:.0f}x the context |
| data | standard-library `.py` source and `pydoc_data.topics` (corpus `{corpus}`, training split), passkey / key-value / fact-QA / title-retrieval / count / copy / induction rows, and {prompts} whole prompts of the evaluation suites in their own templates with their answers: the LongBench-format datasets built from the training split, RULER's niah / vt / cwe / fwe drawn with seeds the evaluation never uses |
| training | {short_steps} steps of {short_batch} x 512-token rows, then {long_steps} steps of {long_batch} x {ctx}-token rows (each row one task of a random span after text){extend}, AdamW (lr {lr}, weight decay {wd}, cosine decay to 10 % per stage), answer tokens weighted x{aw}; {platform}, {minutes:.0f} min |
| training loss at the end | {final_loss} |

Reproduce (deterministic given the seed, the corpus fingerprint and `kvjax/models/default`; resumable):

```
{command}
```

{curve}

## Evaluation (`python -m kvjax.experiments.small_card`)

Held-out next-token loss (windows of {ctx} tokens never trained on): code {loss_code:.3f} (ppl {ppl_code:.1f}),
docs {loss_docs:.3f} (ppl {ppl_docs:.1f}).

Passkey (LongLoRA prompt, exact match, {samples} samples x 5 depths per length, greedy):

| policy | {len_header} |
|---|{len_sep}
| full cache | {len_cells} |
| `{streaming_policy}` at {last_len}, depths 0-0.5 (key outside the window: {outside}) | {streaming:.0f} % |

RULER niah_single_1 at {ctx} tokens, full cache: **{niah:.0f} %** ({niah_samples} samples, RULER's
seed 42, string_match_all).

LongBench-format suite sized for the context (`kvjax/experiments/longbench/data_small`, {lb_samples} samples per
dataset), full cache:

| dataset | {lb_header} |
|---|{lb_sep}
| score | {lb_cells} |

{sink_table}

Retrieval heads (RazorAttention's probe, `heads.json`): {n_ret} of {n_kv} KV heads,
{ret_layout}.

## Limitations
Trained for {minutes:.0f} minutes on 2 CPU cores: it follows the suites' task formats because it saw
them in training, retrieves and copies, and knows nothing else. Numbers on it show how a cache policy
treats a model's use of its context, in miniature; they are not predictions for 7B models.
"""


def final_loss(out: Path, meta: dict, tail: int = 50, kept: str | None = None) -> str:
    """The training loss at the end: one step's loss is one batch's (two rows at 2048 tokens), so the
    mean of the last steps when the curve is kept beside the weights; else what the last card said
    (`kept`, from eval.json: the curve stays in the training folder, which a clone does not have), else
    the last step's, said so."""
    curve = out / "training" / "loss.json"
    if curve.is_file():
        losses = [r["loss"] for r in json.loads(curve.read_text())][-tail:]
        value, how = float(np.mean(losses)), f"mean of the last {len(losses)} steps"
    elif kept is not None:
        return kept
    else:
        value, how = float(meta["final_loss"]), "the last step's batch"
    if not np.isfinite(value):
        raise NonFiniteError(f"the training loss at the end ({how}) is {value} in {curve}: the run diverged")
    return f"{value:.3f} ({how})"


def training_chain(meta: dict, out: Path, ctx: int) -> tuple[list[str], str]:
    """The commands that reproduce the weights in `out`, in order, and the card's words for their
    extension stages. A --from run records its base's meta, so the chain is walked back to the first run."""
    chain, m = [], meta
    while m is not None:
        chain.insert(0, m)
        m = m.get("base")
    commands = [chain[0]["command"]]
    for prev, m in zip(chain, chain[1:]):
        # a model adopted earlier was copied from its run's output to where the next run reads it
        if Path(m["args"]["from_"]).resolve() != Path(prev["args"]["out"]).resolve():
            commands.append(f"# then copy {prev['args']['out']}/{{config.json,model.safetensors}} into "
                            f"{m['args']['from_']}")
        commands.append(m["command"])
    last_out = Path(meta["args"]["out"])
    if last_out.resolve() != Path(out).resolve():  # the weights were copied here from the last command's output
        here = os.path.relpath(out) if Path(out).resolve().is_relative_to(Path.cwd()) else out
        commands.append(f"# then copy {last_out}/{{config.json,model.safetensors}} into {here}")
    # each extension has its own steps, learning rate and rows: the card names them stage by stage
    stages = [m["args"] for m in chain if m["args"].get("extend_steps")]
    if not stages:
        return commands, ""
    steps = sum(a["extend_steps"] for a in stages)
    how = (f" {_stage(stages[0])}" if len(stages) == 1 else
           f" in {len(stages)} extensions ({'; '.join(str(a['extend_steps']) + ' ' + _stage(a) for a in stages)})")
    return commands, (f", then {steps} more steps of {meta['args']['long_batch']} x {ctx}-token rows{how}, "
                      f"suite prompts drawn from twice the prompt pool (a second seed), each task spanning the upper "
                      f"half of the row")


def _stage(args: dict) -> str:
    """One extension's learning rate, row kinds and question density in the card's words (a record from
    before --extend-mixture / --extend-*-queries existed trained on their defaults)."""
    rows = args.get("extend_mixture") or mixture_text(EXTEND_MIXTURE)
    dense = [f"{args[k]} {what}" for k, what in (("extend_kv_queries", "key-value"), ("extend_fact_queries", "fact"))
             if args.get(k)]
    shares = mixture(rows)
    # the kinds that are question-dense whatever the options: their rows' sizes in words
    dense += [what for kind, what in (("titles", f"{TITLE_QUERIES} title ({TITLE_COUNT[0]}-{TITLE_COUNT[1] - 1} "
                                                 "titled paragraphs)"),
                                      ("counts", f"{MARKER_KINDS[0]}-{MARKER_KINDS[1] - 1} count (sounds)"))
              if getattr(shares, kind)]
    return f"from lr {args['extend_lr']} on rows {rows}" + (f" with {' and '.join(dense)} questions per row"
                                                           if dense else "")


def training_record(out: Path) -> tuple[dict, str | None]:
    """The record of the run that trained the weights in `out`, and the training loss at the end when only
    the last card has it: the run's own run.json beside a trained model, else the copy the last card keeps
    in eval.json (the one `train_small --from` reads too) with its loss text, so a clone, which has the
    weights and the card but not the training folder, can write the card again."""
    run_file, card = out / "training" / "run.json", out / "eval.json"
    kept = json.loads(card.read_text()) if card.is_file() else {}
    if run_file.is_file():  # the run's own folder has its curve; the last card may be of other weights
        return json.loads(run_file.read_text()), None
    if "training" not in kept:
        raise MissingFile(f"--model {out}: neither {run_file} nor {card} (with its 'training' record) is there; "
                          f"python -m kvjax.experiments.train_small --out {out} trains a model and writes both")
    return kept["training"], kept.get("loss_at_end")


def write_card(out: Path, data: dict[str, np.ndarray], meta: dict, *, samples: int = 4,
               kept_loss: str | None = None, dest: Path | None = None) -> dict:
    """Evaluates the model in `out` and writes its card (README.md, eval.json, loss.png) into `dest`
    (default: `out`, as `train_small` does for the directory it trained)."""
    from kvjax.models import load

    out = Path(out)
    dest = out if dest is None else Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    # one folder per weights: the passkey log has no identity of its own, so a retrained model must
    # never resume from the records of the weights it replaced
    work = out / "training" / "eval" / model_fingerprint(out)
    lm = load(out)
    ev = evaluate(lm, data, work, samples=samples)
    loss_at_end = final_loss(out, meta, kept=kept_loss)
    write_atomic(dest / "eval.json", dumps_finite({"eval": ev, "training": meta, "loss_at_end": loss_at_end}))
    if (out / "training" / "loss.png").is_file():
        shutil.copy(out / "training" / "loss.png", dest / "loss.png")
    c, a = lm.config, meta["args"]
    commands, extend = training_chain(meta, out, c.max_position_embeddings)
    lengths = list(ev["passkey"]["full"])
    sink, lb = ev["sink"], ev["longbench_full"]
    ret = ev["retrieval_heads"]
    layout = "; ".join(f"layer {i}: {[h for h, x in enumerate(row) if x]}" for i, row in enumerate(ret["kv_heads"])
                       if any(row))
    text = CARD.format(
        params=meta["parameters"] / 1e6, init_layers=2, layers=c.num_layers, hidden=c.hidden_size,
        heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim, ffn=c.intermediate_size,
        theta=c.rope.theta, ctx=c.max_position_embeddings, stretch=c.max_position_embeddings / 512,
        vocab=c.vocab_size, corpus=meta["corpus"], prompts=meta["suite_prompts"], short_steps=a["short_steps"],
        short_batch=a["short_batch"], long_steps=a["long_steps"], long_batch=a["long_batch"], lr=a["lr"],
        wd=a["weight_decay"], aw=a["answer_weight"],
        platform=f"{meta['platform'].upper()} ({meta.get('cores', '?')} cores)", minutes=meta["train_minutes"],
        final_loss=loss_at_end, command="\n".join(commands),
        curve="![loss curve](loss.png)" + ("" if "base" not in meta else
                                           "\n\nThe curve is the last command's, its steps numbered in the whole run."),
        extend=extend,
        loss_code=ev["heldout_loss"]["code"], ppl_code=np.exp(ev["heldout_loss"]["code"]),
        loss_docs=ev["heldout_loss"]["docs"], ppl_docs=np.exp(ev["heldout_loss"]["docs"]), samples=samples,
        len_header=" | ".join(f"{n} tokens" for n in lengths), len_sep="---|" * len(lengths),
        len_cells=" | ".join(f"{100 * ev['passkey']['full'][n]:.0f} %" for n in lengths),
        streaming_policy=ev["passkey"]["streaming_policy"], last_len=lengths[-1],
        outside="yes" if ev["passkey"]["streaming_key_outside_window"] else "NO",
        streaming=100 * ev["passkey"]["streaming"], niah=ev["ruler_niah_single_1"]["score"],
        niah_samples=ev["ruler_niah_single_1"]["samples"], lb_samples=5 * samples,
        lb_header=" | ".join(d.removeprefix("stdlib_") for d in lb), lb_sep="---|" * len(lb),
        lb_cells=" | ".join(f"{v:.1f}" for v in lb.values()),
        sink_table=sink_table(sink, c.max_position_embeddings),
        n_ret=ret["count"], n_kv=ret["of"], ret_layout=layout or "none",
    )
    write_atomic(dest / "README.md", text)
    return ev


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.small_card", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=str(SMALL_DIR), help=model_help("%(default)s"))
    p.add_argument("--samples", type=positive_int, default=4, help="passkey samples per (length, depth); RULER and "
                                                                   "LongBench take 5x as many")
    p.add_argument("--out", default="results/small_card",
                   help="where the card (README.md, eval.json, loss.png) is written (default: results/small_card), never the model's own "
                        "directory by default (a committed card is rewritten only when asked: --out kvjax/models/small)")
    cli.add_compile_cache_flag(p)
    args = p.parse_args(argv)
    out = Path(args.model)
    meta, kept_loss = training_record(out)
    if meta["corpus"] != corpus.fingerprint():
        raise InvalidInput(f"--model {out} was trained and carded on corpus {meta['corpus']}; this Python's standard "
                           f"library is {corpus.fingerprint()}, whose held-out text would give other numbers")
    data = tokenize_corpus(load_tokenizer(out), out / "training" / "data.npz")  # cached, as train_small's
    ev = write_card(out, data, meta, samples=args.samples, kept_loss=kept_loss, dest=Path(args.out))
    print(f"wrote the card of {out} into {args.out}", file=sys.stderr)
    print(json.dumps(ev, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
