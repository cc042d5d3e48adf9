"""Training KVzap's surrogates (a linear one and a two-layer MLP) on kvjax's KVzip+ scores of a model's own text.

    python -m kvjax.experiments.train_kvzap --model smollm2 --out kvjax/models/kvzap/smollm2
    python -m kvjax.experiments.train_kvzap --out kvjax/models/kvzap/kvjax-small          # the embedded default model

For each of --texts windows of --length tokens of the training text (the default text's training topics, or the
first four fifths of --data: `kvjax.experiments.common.split_text`), the model reads the window whole under KVzip+
(`--policy kvzip-plus`: one replay of the window, raw text), and --per-text of its tokens, drawn at random, give
each layer's attention input and the log of the token's KVzip+ score per KV head (`kvjax.kvzap.collect`). Then a
ridge regression per layer (kvpress's `Ridge()`) and an MLP per layer (--hidden units, AdamW with optax for
--epochs, kvpress's recipe) are fitted, and both are scored on --heldout-texts windows of the held-out text
(never trained on): Spearman's rank correlation with KVzip+ over all held-out pairs, and per KV head.

Writes OUT/linear and OUT/mlp (`--policy kvzap --kvzap OUT/mlp --threshold T`; `kvjax.surrogate`), OUT/results.md
and .json (the correlations, and for each share of held-out pairs the threshold that evicts it), OUT/loss.png
(the MLP's training and validation loss per epoch). The collected windows are kept in OUT/data, one file each,
written atomically: a killed run resumes, and collects nothing twice.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from kvjax.experiments import cli, driver
from kvjax.experiments.common import SPLIT_RULE, add_run_args, held_out_windows, model_help, positive_int, training_windows
from kvjax.experiments.records import write_atomic
from kvjax import kvzap
from kvjax.policies import make_policy
from kvjax.cli import HelpFormatter

SHARES = (0.25, 0.5, 0.75, 0.875, 0.9375, 0.96875)  # the leaderboard's ratios: the threshold that evicts each


def _collected(path: Path, collect) -> tuple[np.ndarray, np.ndarray]:
    """One window's (X, y), from `path` if an earlier run wrote it, else collected and written atomically."""
    if path.is_file():
        with np.load(path) as f:
            return f["x"], f["y"]
    x, y = collect()
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, x=x, y=y)
    tmp.replace(path)
    return x, y


def _gather(out: Path, name: str, windows: np.ndarray, model, policy, per_text: int | None, seed: int):
    from tqdm.auto import tqdm

    out.mkdir(parents=True, exist_ok=True)
    xs, ys = [], []
    for i, ids in enumerate(tqdm(windows, desc=f"KVzip+ scores, {name}", unit="text")):
        x, y = _collected(out / f"{name}-{i:04d}.npz",
                          lambda ids=ids, i=i: kvzap.collect(model, ids[None], policy, per_text, seed + i))
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def _loss_plot(path: Path, history: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3))
    epochs = np.arange(1, len(history["train"]) + 1)
    ax.plot(epochs, history["train"], marker="o", label="training")
    ax.plot(epochs, history["valid"], marker="o", label="validation (5 % of the training pairs)")
    ax.set(xlabel="epoch", ylabel="mean squared error (log KVzip+)", title="KVzap MLP surrogate")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.train_kvzap", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", help=model_help("the embedded kvjax-small"))
    p.add_argument("--out", required=True, help="where the surrogates, the tables and the collected data go")
    p.add_argument("--data", nargs="*", help="text files (default: the offline default text)")
    p.add_argument("--texts", type=positive_int, default=64, help="training windows")
    p.add_argument("--heldout-texts", type=positive_int, default=8, help="held-out windows the correlations are on")
    p.add_argument("--length", type=positive_int, default=1024,
                   help="tokens per window (kvpress: texts of 750-1250 tokens)")
    p.add_argument("--per-text", type=positive_int, default=256,
                   help="tokens drawn from each window (kvpress: 500 of about 1000)")
    p.add_argument("--hidden", type=positive_int, default=32,
                   help="the MLP's hidden units (kvpress: 512 for hidden size 4096)")
    p.add_argument("--epochs", type=positive_int, default=15, help="the MLP's passes over the training pairs")
    p.add_argument("--lr", type=float, default=5e-3, help="the MLP's peak learning rate (AdamW, cosine decay to 0)")
    p.add_argument("--batch", type=positive_int, default=512, help="tokens per MLP optimizer step")
    p.add_argument("--seed", type=int, default=0,
                   help="the random seed of the training windows, the tokens drawn and the MLP's initialisation")
    add_run_args(p)
    args = p.parse_args(argv)
    started = time.perf_counter()

    lm = driver.load_model(args.model, allow_nonfinite=args.allow_nonfinite)
    if args.length > lm.config.max_position_embeddings:
        raise driver.ArgumentError(f"--length {args.length} exceeds the model's max_position_embeddings="
                                   f"{lm.config.max_position_embeddings}", usage=False)
    held = held_out_windows(lm.tokenizer, args.data, args.length, args.heldout_texts, "--heldout-texts", "--length")
    train = training_windows(lm.tokenizer, args.data, args.length, "--length")
    if len(train) < args.texts:
        raise driver.ArgumentError(f"--texts {args.texts} with --length {args.length}: the training text holds "
                                   f"{len(train)} windows", usage=False)
    train = train[np.sort(np.random.RandomState(args.seed).permutation(len(train))[:args.texts])]
    options = {k: getattr(args, k) for k in ("data", "length", "per_text", "seed")}
    out = driver.call(p, driver.claim, args.out, lm, options, files=("data",), selection=("texts", "heldout_texts"),
                      extra={"held-out text": SPLIT_RULE})
    identity = json.loads((out / "identity.json").read_text())
    command = "python -m kvjax.experiments.train_kvzap " + " ".join(sys.argv[1:] if argv is None else argv)
    policy = make_policy("kvzip-plus", ratio=0.5, replay=driver.kvzip_replay(lm.path, chat=False))
    x, y = _gather(out / "data", "train", train, lm.model, policy, args.per_text, args.seed)
    xh, yh = _gather(out / "data", "heldout", held, lm.model, policy, args.per_text, args.seed + 10_000)
    collected = time.perf_counter() - started

    print(f"fitting  on {len(x)} tokens x {x.shape[1]} layers ({args.texts} texts), held out {len(xh)}")
    linear = kvzap.fit_linear(x, y)
    mlp, history = kvzap.fit_mlp(x, y, args.hidden, epochs=args.epochs, lr=args.lr, batch=args.batch, seed=args.seed,
                                 progress=lambda e, t, v: print(f"epoch {e + 1:3d}  train {t:.4f}  valid {v:.4f}"))
    wall = time.perf_counter() - started
    results = {"model": lm.path.name, "weights": identity["weights"], "command": command, "texts": args.texts, "heldout_texts": args.heldout_texts,
               "length": args.length, "per_text": args.per_text, "train_pairs": int(y.size),
               "collect_s": round(collected, 1), "wall_s": round(wall, 1), "mlp_history": history, "kinds": {}}
    for kind, s in (("linear", linear), ("mlp", mlp)):
        scores = kvzap.rank_correlation(s, xh, yh)
        pred = kvzap.predict(s, xh)
        scores["threshold_evicting"] = {f"{r:g}": float(np.quantile(pred, r)) for r in SHARES}
        results["kinds"][kind] = scores
        s.save(out / kind, info={"trained_on": lm.path.name, "weights": identity["weights"], "texts": args.texts, "length": args.length,
                                 "per_text": args.per_text, "hidden": args.hidden if kind == "mlp" else None,
                                 "heldout": scores, "command": command})
    _loss_plot(out / "loss.png", history)
    write_atomic(out / "results.json", json.dumps(results, indent=1) + "\n")
    lines = [f"# KVzap surrogates for {lm.path.name}", "",
             f"Trained on {args.texts} windows of {args.length} tokens ({args.per_text} drawn from each: "
             f"{len(x)} tokens x {x.shape[1]} layers x {y.shape[2]} KV heads), scored on {args.heldout_texts} held-out "
             f"windows ({len(xh)} tokens). Wall time {wall:.0f} s ({collected:.0f} s collecting KVzip+ scores).", "",
             "| surrogate | Spearman, all held-out pairs | Spearman, mean per layer and KV head | MSE (log score) | "
             + " | ".join(f"threshold evicting {r:g}" for r in SHARES) + " |",
             "|---|---|---|---|" + "---|" * len(SHARES)]
    for kind, r in results["kinds"].items():
        lines.append(f"| {kind} | {r['spearman_all_pairs']:.3f} | {r['spearman_mean_per_head']:.3f} | {r['mse']:.3f} | "
                     + " | ".join(f"{v:.2f}" for v in r["threshold_evicting"].values()) + " |")
    lines += ["", "A threshold evicts that share of the held-out pairs by their predicted score (before the sliding "
                  "window, which never evicts its tokens); on other text the share differs: a run's `kv_held` says "
                  "what it held.", "", "![loss](loss.png)", ""]
    write_atomic(out / "results.md", "\n".join(lines))
    print("\n".join(lines[4:4 + 2 + len(results["kinds"])]))
    print(f"wrote    {out / 'linear'}, {out / 'mlp'} (--policy kvzap --kvzap DIR --threshold T), {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
