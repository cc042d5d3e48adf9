"""Attention-Gate against the training-free baselines at the same eviction ratio (Table 1 in miniature).

    python -m kvjax.experiments.eval_gate --model DIR --gate-params DIR [--data a.txt ...] [--windows 32]
                                    [--seq-len 256] [--prefix 0.75] [--out DIR]

On held-out text windows (the first `--windows` of the held-out text, which `kvjax.experiments.train_gate`
never reads: the held-out topics of the default text, or the last fifth of --data; asking for more
windows than it holds, or scoring text the gates were trained on, is an error):

* held-out LM loss of the base model and of the gated model (eq. 7 forward);
* the eviction ratio of every layer and KV head (eviction.json / eviction.png, Figure 1);
* the continuation protocol: each window's first `--prefix` share is prefilled under a
  policy (the cache is compressed), the rest is scored reading that cache
  (`kvjax.drive.extend`); its NLL under FullCache, the gates, and LocalWindow / StreamingLLM /
  H2O with the budget that evicts the gates' measured share of the prefix (matched eviction),
  or a fixed share with `--baseline-eviction 0.5` (the paper's Table 1 protocol). Each policy's
  difference from the full cache comes with its standard error, paired over windows.

Writes results.json and results.md in --out; each part is kept in parts.jsonl as it is computed, so
a killed run resumes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax import engine
from kvjax.experiments import cli, driver
from kvjax.experiments.common import (
    add_run_args,
    fraction_removed,
    held_out_windows,
    model_help,
    positive_int,
    refuse_trained_text,
)
from kvjax.experiments.records import ResultLog, dumps_finite, write_atomic
from kvjax.cache import LayerCache
from kvjax.engine import compiled
from kvjax.errors import InvalidInput
from kvjax.gate import eviction_ratios, without_gates
from kvjax.policies import GateEviction, make_policy
from kvjax.train import next_token_loss
from kvjax import drive
from kvjax.cli import HelpFormatter


def held_out(tok, data: list[str] | None, seq_len: int, n: int, count_flag: str = "--windows") -> np.ndarray:
    """The windows scored: the first `n` of the held-out text, which `kvjax.experiments.train_gate` never reads
    (`kvjax.experiments.common.split_text`)."""
    return held_out_windows(tok, data, seq_len, n, count_flag)


@compiled()
def _losses(model, tokens):
    logits, flags = drive.forward(model, tokens)
    return next_token_loss(logits, tokens), flags


@compiled(static=("policy",))
def _cont_nll(model, prefix, cont, *, policy):
    """(each row's mean NLL of `cont` given `prefix` compressed by `policy` `[b]`, the share of the prefix's
    tokens its cache holds, averaged over layers, KV heads and rows): the continuation reads the cache."""
    b, p = prefix.shape
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), prefix.shape)
    plan = drive.plan(model, policy, p + cont.shape[1], p)
    last, cache = drive.prompt(model, prefix, pos, plan)
    cpos = jnp.broadcast_to(jnp.arange(p, p + cont.shape[1] - 1, dtype=jnp.int32), (b, cont.shape[1] - 1))
    logits = jnp.concatenate([last[:, None], drive.extend(model, cont[:, :-1], cpos, cache, plan)], axis=1)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    held = [c.pos if isinstance(c, LayerCache) else jnp.concatenate([g.pos for g in c.groups], axis=1) for c in cache]
    kept = jnp.mean(jnp.stack([jnp.mean(jnp.sum((h >= 0) & (h < p), axis=-1) / p) for h in held]))
    return -jnp.mean(jnp.take_along_axis(lp, cont[..., None], axis=-1)[..., 0], axis=1), kept


def evaluate(model, tokens: np.ndarray, prefix_share: float = 0.75, batch: int = 8, sinks: int = 4,
             baseline_eviction: float | None = None, log: ResultLog | None = None) -> dict:
    """Every number of the module docstring for `model` (with gates attached) on `tokens` `[n, T]`.

    With a `log`, each part (the held-out losses and eviction, each policy's continuation NLL) is a
    record as soon as it is computed, and a part already there is not recomputed: a killed run resumes."""
    if not 0 < prefix_share < 1:
        raise InvalidInput(f"prefix share {prefix_share} must be in (0, 1)")
    # the gated model and the same weights without gates: two structures, two compiled programs
    graphdef, state = engine.split(model)
    with without_gates(model):
        base_graph, base_state = engine.split(model)
    batches = [jnp.asarray(tokens[i : i + batch]) for i in range(0, len(tokens), batch)]
    p = int(tokens.shape[1] * prefix_share)

    def part(key, compute):
        if log is not None and key in log:
            return log.records[key]
        rec = {"id": key, **compute()}
        if log is not None:
            log.add(rec)
        return rec

    def losses():
        base_loss = np.mean([float(_losses.pure(base_graph, base_state, t)[0]) for t in batches])
        gated, flags = [], []
        for t in batches:
            loss, f = _losses.pure(graphdef, state, t)
            gated.append(float(loss))
            flags.append([np.asarray(x) for x in f])
        per_head = np.mean([eviction_ratios(f, np.ones(f[0].shape[::2], np.float32)) for f in flags], axis=0)
        # The gates' eviction over the prefix alone (what its cache drops): flags are causal, so
        # the prefix's flags in a full-window forward are its flags.
        prefix_evicted = float(np.mean([1 - np.mean([x[:, :, :p].mean() for x in f]) for f in flags]))
        return {"base": float(base_loss), "gated": float(np.mean(gated)), "per_layer_head": per_head.tolist(),
                "prefix_evicted": prefix_evicted}

    held = part("heldout", losses)
    per_head, prefix_evicted = np.asarray(held["per_layer_head"]), held["prefix_evicted"]
    # the baselines evict the gates' measured share (matched eviction), or a fixed one (Table 1: 50 %)
    evicted = prefix_evicted if baseline_eviction is None else baseline_eviction
    budget = max(sinks + 1, int(round((1 - evicted) * p)))
    policies = {
        "full": (make_policy("full"), base_graph, base_state),
        "gate": (GateEviction(), graphdef, state),
        "local": (make_policy("local", budget), base_graph, base_state),
        "streaming": (make_policy("streaming", budget, sinks=sinks), base_graph, base_state),
        "h2o": (make_policy("h2o", budget), base_graph, base_state),
    }
    cont, kept, per_window = {}, {}, {}
    for name, (policy, g, s) in tqdm(policies.items(), desc="continuations"):
        def compute(policy=policy, g=g, s=s):
            runs = [_cont_nll.pure(g, s, t[:, :p], t[:, p:], policy=policy) for t in batches]
            rows = np.concatenate([np.asarray(r[0]) for r in runs])
            return {"nll": float(rows.mean()), "nll_windows": rows.tolist(),
                    "kept_prefix": float(np.mean([float(r[1]) for r in runs]))}
        rec = part(f"continuation|{policy.describe()}", compute)
        cont[name], kept[name] = rec["nll"], rec.get("kept_prefix")
        per_window[name] = rec.get("nll_windows")  # absent in records written before 2026-11-26
    return {"windows": int(len(tokens)), "seq_len": int(tokens.shape[1]), "prefix": p,
            "heldout_loss": {"base": held["base"], "gated": held["gated"]},
            "eviction": {"mean": float(per_head.mean()), "prefix": prefix_evicted, "per_layer_head": per_head.tolist()},
            "baseline_eviction": evicted, "baseline_eviction_source": "gates" if baseline_eviction is None else "fixed",
            "baseline_budget": budget, "continuation_nll": cont, "kept_prefix": kept,
            "nll_windows": per_window, "delta_se": paired_se(per_window),
            # the claim itself: the gates against each baseline at the same eviction (or Table 1's fixed one)
            "gate_minus_baseline": {k: {"diff": cont["gate"] - cont[k], "se": v}
                                    for k, v in paired_se(per_window, ref="gate").items() if k not in ("full", "gate")}}


def paired_se(per_window: dict[str, list[float] | None], ref: str = "full") -> dict[str, float | None]:
    """The standard error of each policy's mean NLL difference from `ref`'s, paired over windows (every
    policy reads the same windows, so the windows' own difficulty cancels); None without per-window NLLs."""
    base = per_window.get(ref)
    out = {}
    for name, rows in per_window.items():
        if base is None or rows is None or len(rows) < 2:
            out[name] = None
            continue
        d = np.asarray(rows) - np.asarray(base)
        out[name] = float(d.std(ddof=1) / np.sqrt(len(d)))
    return out


def write_report(out: Path, r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "results.json", dumps_finite(r))  # the report reads its verdict from here: no NaN
    ev = np.asarray(r["eviction"]["per_layer_head"])
    write_atomic(out / "eviction.json", dumps_finite({"per_layer_head": ev.tolist()}))
    fig, ax = plt.subplots(figsize=(1.2 + 0.5 * ev.shape[1], 1 + 0.35 * ev.shape[0]))
    im = ax.imshow(ev, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set(xlabel="KV head", ylabel="layer", title="Attention-Gate eviction ratio")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out / "eviction.png", dpi=100)
    plt.close(fig)
    h, c = r["heldout_loss"], r["continuation_nll"]
    lines = [f"# Attention-Gate, {r['windows']} held-out windows of {r['seq_len']} tokens", "",
             f"Held-out LM loss: base {h['base']:.4f}, gated {h['gated']:.4f} ({h['gated'] - h['base']:+.4f}); "
             f"mean eviction {r['eviction']['mean']:.1%}", "",
             f"Continuation NLL after a {r['prefix']}-token prefix compressed by each policy (the gates evict "
             f"{r['eviction']['prefix']:.1%} of it; baselines keep {r['baseline_budget']} tokens, evicting "
             f"{r['baseline_eviction']:.1%}, {'as the gates do' if r['baseline_eviction_source'] == 'gates' else 'fixed'}):",
             "",
             "| policy | NLL | Δ vs full | s.e. of Δ (paired over windows) |", "|---|---|---|---|"]
    se = r.get("delta_se", {})
    lines += [f"| {k} | {v:.4f} | {v - c['full']:+.4f} | " + ("—" if k == "full" or se.get(k) is None
                                                               else f"{se[k]:.4f}") + " |" for k, v in c.items()]
    vs = r.get("gate_minus_baseline", {})
    if any(d["se"] is not None for d in vs.values()):
        lines += ["", "The gates' NLL minus each baseline's (paired over windows; positive: the gates lose more):", "",
                  "| baseline | gate − baseline | s.e. |", "|---|---|---|"]
        lines += [f"| {k} | {d['diff']:+.4f} | {d['se']:.4f} |" for k, d in vs.items() if d["se"] is not None]
    lines += ["", "Eviction per layer (mean over KV heads): "
              + ", ".join(f"L{i} {x:.0%}" for i, x in enumerate(ev.mean(1)))]
    write_atomic(out / "results.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.eval_gate", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help=model_help())
    p.add_argument("--gate-params", required=True,
                   help="the trained gates: a directory written by python -m kvjax.experiments.train_gate")
    p.add_argument("--data", nargs="*", help="text files (default: pydoc_data.topics)")
    p.add_argument("--windows", type=positive_int, default=32, help="held-out text windows scored (the first N)")
    p.add_argument("--seq-len", type=positive_int, default=256, help="tokens per window")
    p.add_argument("--prefix", type=float, default=0.75, help="fraction of each window that is the prompt, in (0, 1)")
    p.add_argument("--baseline-eviction", type=fraction_removed,
                   help="the baselines' eviction share of the prefix (Table 1: 0.5); default: the gates' measured share")
    p.add_argument("--out", help="default: --gate-params/eval")
    add_run_args(p)
    args = p.parse_args(argv)
    if not 0 < args.prefix < 1:
        p.error(f"argument --prefix: {args.prefix} must be in (0, 1)")
    lm = driver.load_model(args.model, allow_nonfinite=args.allow_nonfinite, gate_params=args.gate_params)
    refuse_trained_text(args.gate_params, args.data, held_out_only=True)  # it scores the held-out part only
    tokens = held_out(lm.tokenizer, args.data, args.seq_len, args.windows)  # before any record is written
    out = Path(args.out or Path(args.gate_params) / "eval")
    # Resumable part by part (OUT/parts.jsonl), never over another configuration's parts.
    log = driver.call(p, driver.open_records, out, lm, "parts.jsonl", {"data": args.data, "windows": args.windows,
                                                       "seq_len": args.seq_len, "prefix": args.prefix,
                                                       "baseline_eviction": args.baseline_eviction}, files=("data",))
    result = evaluate(lm.model, tokens, args.prefix,
                      baseline_eviction=args.baseline_eviction, log=log)
    dumps_finite(result)  # a NaN loss is an error, not a number in the table
    write_report(out, result)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
