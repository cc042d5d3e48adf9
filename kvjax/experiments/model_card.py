"""The embedded default model's card: evaluation numbers measured on the trained model.

    python -m kvjax.experiments.model_card [--model kvjax/models/default]

Measures held-out loss (standard-library modules and doc topics never trained on), passkey
accuracy with the full cache and with StreamingLLM whose window excludes the key, and the
attention-sink share of the first token per layer; writes README.md (the card), eval.json, and
copies the loss curve next to the weights. `kvjax.experiments.train_tiny` calls it when training ends.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.experiments import cli, passkey
from kvjax.experiments.common import model_help
from kvjax.experiments.records import ResultLog
from kvjax.policies import FullCache, StreamingLLM
from kvjax.models import DEFAULT_DIR
from kvjax import drive
from kvjax.cli import HelpFormatter

SINK_SKIP = 16  # queries this early attend few keys, so any key gets a large share: left out


def heldout_loss(model, stream: np.ndarray, seq_len: int, windows: int, bos: int) -> float:
    """Mean next-token NLL over `windows` evenly spaced windows of `stream` (each after a BOS)."""
    starts = np.linspace(0, len(stream) - seq_len, windows).astype(int)
    tokens = np.stack([np.concatenate([[bos], stream[s : s + seq_len - 1]]) for s in starts]).astype(np.int32)
    nll = []
    for row in tokens:  # one row at a time keeps the memory small on CPU
        logits = drive.logits(model, jnp.asarray(row[None]))
        lp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), -1)
        nll.append(-np.asarray(jnp.take_along_axis(lp, jnp.asarray(row[1:, None]), -1))[1:].mean())
    return float(np.mean(nll))


def sink_shares(model, tokens: np.ndarray) -> dict[str, list[float]]:
    """Per layer: attention probability on position 0, averaged over queries >= SINK_SKIP (and rows), for
    the mean head and for the head that gives it most; the same average for uniform attention
    (1 / (query + 1)) is the no-sink reference."""
    from kvjax.heads import attention_maps

    maps = attention_maps(model, jnp.asarray(tokens))
    t = tokens.shape[1]
    per_head = [np.asarray(p[:, :, SINK_SKIP:, 0].mean(axis=(0, 2))) for p in maps]  # p: [B, H, T, T]
    uniform = float(np.mean(1.0 / (np.arange(SINK_SKIP, t) + 1)))
    return {"first_token_share": [float(h.mean()) for h in per_head],
            "strongest_head_share": [float(h.max()) for h in per_head], "uniform_share": [uniform] * len(maps)}


def evaluate(lm, data: dict[str, np.ndarray], work: Path, *, samples: int = 4) -> dict:
    model, tok, cfg = lm.model, lm.tokenizer, lm.config
    n = cfg.max_position_embeddings
    ev = {"heldout_loss": {name: heldout_loss(model, data[f"{name}_heldout"], n, 8, tok.bos_token_id)
                           for name in ("code", "docs")}}
    lengths = passkey.default_lengths(tok, n)
    log = ResultLog(work / "passkey.jsonl")
    full = passkey.run(model, tok, FullCache(), lengths, [0.0, 0.25, 0.5, 0.75, 1.0], samples, log, label="full")
    # Budget n/4: at the longest length a key at depth <= 0.5 lies outside sinks + window.
    stream = StreamingLLM(budget=n // 4, sinks=4)
    st = passkey.run(model, tok, stream, [n - passkey.MAX_NEW_TOKENS], [0.0, 0.25, 0.5], samples, log,
                     label="streaming")
    outside = [r for r in st if r["needle_at"] + 20 < r["length"] - (n // 4 - 4)]
    ev["passkey"] = {
        "full": {str(k): float(np.mean(list(v.values()))) for k, v in passkey.accuracy_table(full).items()},
        "full_at_training_length": float(np.mean([r["correct"] for r in full if r["length"] == lengths[-1]])),
        "streaming": float(np.mean([r["correct"] for r in st])),
        "streaming_policy": stream.describe(),
        "streaming_key_outside_window": len(outside) == len(st),
        "samples_per_cell": samples,
    }
    rows = np.stack([np.concatenate([[tok.bos_token_id], data["docs_heldout"][s : s + n - 1]])
                     for s in (0, len(data["docs_heldout"]) // 2)]).astype(np.int32)
    ev["sink"] = sink_shares(model, rows)
    return ev


def sink_table(sink: dict, ctx: int) -> str:
    """The card's attention-sink paragraph and table, from `sink_shares`."""
    first, strongest, uniform = sink["first_token_share"], sink["strongest_head_share"], sink["uniform_share"]
    cells = lambda xs, fmt: " | ".join(format(x, fmt) for x in xs)  # noqa: E731
    return "\n".join([
        "Attention-sink share: attention probability on the first token (`<s>`), averaged over queries",
        f"{SINK_SKIP}..{ctx - 1} of held-out docs, for the mean head and the strongest head of each layer, against",
        f"{uniform[0]:.4f} for uniform attention:", "",
        f"| layer | {' | '.join(map(str, range(len(first))))} |", "|---|" + "---|" * len(first),
        f"| mean head | {cells(first, '.3f')} |",
        f"| x uniform | {cells([a / u for a, u in zip(first, uniform)], '.1f')} |",
        f"| strongest head | {cells(strongest, '.3f')} |",
        f"| x uniform | {cells([a / u for a, u in zip(strongest, uniform)], '.1f')} |",
    ])


CARD = """# kvjax-tiny-stdlib: the embedded default model

A {params:.2f} M-parameter Llama ({attention}, RoPE) trained **from scratch by kvjax** on the Python standard
library, so that cache policies can be compared on a model that actually uses its context, with no
download. It is a research fixture, not a useful language model.

| | |
|---|---|
| architecture | Llama: {layers} layers, hidden {hidden}, {heads} query / {kv_heads} KV heads (head dim {head_dim}), SwiGLU {ffn}, RoPE theta 10000, untied head |
| context | {ctx} tokens (the training length; `max_position_embeddings`) |
| tokenizer | byte-level BPE, {vocab} tokens, digits split one by one, trained with `tokenizers` on the training split; prepends `<s>` |
| data | standard-library `.py` source and `pydoc_data.topics` (corpus `{corpus}`), 1 file / topic in 10 held out by a hash of its name; mixed with synthetic passkey, key-value, fact-QA, copy and induction tasks (`kvjax/experiments/tasks.py`) |
| training | {steps} steps x {tokens_per_step} tokens, AdamW (lr {lr}, weight decay {wd}; constant in the warm stage, then a fresh optimizer with cosine decay to 10 %), answer tokens weighted x{aw}; the first {warm_steps} steps are {warm_batch} x {warm_len}-token rows of short repeats with {warm_kv_heads} KV heads (induction heads form there){conversion}, then the tasks grow to the full row over {curriculum:.0%} of the rest; {platform}, {minutes:.0f} min |
| final training loss | {final_loss:.3f} |

Reproduce (deterministic given the seed and the corpus fingerprint; resumable):

```
{command}
```

![loss curve](loss.png)

## Evaluation (`python -m kvjax.experiments.model_card`)

Held-out next-token loss (windows of {ctx} tokens never trained on): code {loss_code:.3f} (ppl {ppl_code:.1f}),
docs {loss_docs:.3f} (ppl {ppl_docs:.1f}).

Passkey (LongLoRA prompt, exact match, {samples} samples x 5 depths per length, greedy):

| policy | {len_header} |
|---|{len_sep}
| full cache | {len_cells} |
| {streaming_policy} at {last_len}, depths 0-0.5 (key outside the window) | {streaming:.0f} % |

{sink_table}

## Limitations
Tiny, trained for {minutes:.0f} minutes on {corpus_short} text: it writes plausible Python-flavoured text, retrieves
keys and copies, and knows nothing else. Numbers on it show how a cache policy treats a model's use of
context, in miniature; they are not predictions for 7B models.
"""


def write_card(out: Path, data: dict[str, np.ndarray], meta: dict, *, samples: int = 4, dest: Path | None = None) -> dict:
    """Evaluates the model in `out` and writes its card into `dest` (default `out`: `train_tiny`'s own run)."""
    from kvjax.experiments.records import write_atomic
    from kvjax.models import load

    out = Path(out)
    dest = out if dest is None else Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    work = out / "training"
    lm = load(out)
    ev = evaluate(lm, data, work, samples=samples)
    write_atomic(dest / "eval.json", json.dumps({"eval": ev, "training": meta}, indent=2))
    if (work / "loss.png").is_file():
        shutil.copy(work / "loss.png", dest / "loss.png")
    c, a = lm.config, meta["args"]
    lengths = list(ev["passkey"]["full"])
    sink = ev["sink"]
    text = CARD.format(
        params=meta["parameters"] / 1e6, layers=c.num_layers, hidden=c.hidden_size, heads=c.num_heads,
        kv_heads=c.num_kv_heads, head_dim=c.head_dim, ffn=c.intermediate_size, ctx=c.max_position_embeddings,
        vocab=c.vocab_size, corpus=meta["corpus"], steps=a["steps"], tokens_per_step=meta["tokens_per_step"],
        lr=a["lr"], wd=a["weight_decay"], aw=a["answer_weight"], curriculum=a["curriculum"],
        platform=f"{meta['platform'].upper()} ({meta.get('cores', '?')} cores)", minutes=meta["train_minutes"],
        final_loss=meta["final_loss"], command=meta["command"],
        loss_code=ev["heldout_loss"]["code"], ppl_code=np.exp(ev["heldout_loss"]["code"]),
        loss_docs=ev["heldout_loss"]["docs"], ppl_docs=np.exp(ev["heldout_loss"]["docs"]), samples=samples,
        len_header=" | ".join(f"{n} tokens" for n in lengths), len_sep="---|" * len(lengths),
        len_cells=" | ".join(f"{100 * ev['passkey']['full'][n]:.0f} %" for n in lengths),
        streaming_policy=ev["passkey"]["streaming_policy"], last_len=lengths[-1],
        streaming=100 * ev["passkey"]["streaming"],
        sink_table=sink_table(sink, c.max_position_embeddings),
        attention="GQA" if c.num_kv_heads < c.num_heads else "MHA",
        warm_kv_heads=a.get("warm_kv_heads") or c.num_kv_heads,
        conversion=(f", mean-pooled to {c.num_kv_heads} KV heads (GQA's uptraining recipe, `kvjax.models.gqa`)"
                    if (a.get("warm_kv_heads") or c.num_kv_heads) != c.num_kv_heads else ""),
        warm_steps=a.get("warm_steps", 0), warm_batch=a.get("warm_batch", 0), warm_len=a.get("warm_len", 0),
        corpus_short="standard-library",
    )
    write_atomic(dest / "README.md", text)
    return ev


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.model_card", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_DIR), help=model_help("%(default)s"))
    p.add_argument("--samples", type=int, default=4, help="passkey samples per (length, depth)")
    p.add_argument("--out", default="results/model_card",
                   help="where the card is written (default: results/model_card), never the model's own directory by default (--out kvjax/models/default "
                        "rewrites the committed card)")
    cli.add_compile_cache_flag(p)
    args = p.parse_args(argv)
    out = Path(args.model)
    meta_file = out / "eval.json"
    run_file = out / "training" / "run.json"
    if run_file.is_file():
        meta = json.loads(run_file.read_text())
    elif meta_file.is_file():
        meta = json.loads(meta_file.read_text())["training"]
    else:
        p.error(f"{out} has neither training/run.json nor eval.json: not a model from kvjax.experiments.train_tiny")
    data_file = out / "training" / "data.npz"
    if not data_file.is_file():
        p.error(f"{data_file} is missing: rerun python -m kvjax.experiments.train_tiny --out {out} (it resumes)")
    with np.load(data_file) as f:
        data = dict(f)
    ev = write_card(out, data, meta, samples=args.samples, dest=Path(args.out))
    print(json.dumps(ev, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
