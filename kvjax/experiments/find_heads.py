"""Find RazorAttention's retrieval heads and write them to a heads file.

    python -m kvjax.experiments.find_heads --model DIR --out heads.json [--k 2500] [--plot heads.png]

RoPE models: the paper's probe (BOS + K random tokens repeated 4 times); the top
14 % of heads by induction score and the top 1 % by echo score are retrieval heads.
ALiBi models: every head's Theorem-1 vision scope L_h is written as well, and
the RazorAttention policy reads those instead. Use the file with
`--policy razor --heads heads.json`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from kvjax.experiments import cli, driver
from kvjax.experiments.common import add_run_args, model_help
from kvjax.experiments.records import shown
from kvjax import heads as H
from kvjax.errors import require_finite
from kvjax.models import load
from kvjax.cli import HelpFormatter


def find(lm, out, *, k: int = 2500, repeats: int = 4, seed: int = 0, induction_ratio: float = 0.14,
         echo_ratio: float = 0.01, eps: float = 1e-3, bound: str = "paper", control: str | None = None,
         plot: str | None = None, progress: bool = False, duo_texts: int = 0,
         duo_len: int = 1024) -> tuple[dict, H.HeadScores]:
    """RazorAttention's probe on `lm`: scores every head, selects the retrieval heads and writes the
    heads file `out` (and its heatmap, `plot` or next to it). Returns (the file's fields, the scores)."""
    for name, value in (("induction_ratio", induction_ratio), ("echo_ratio", echo_ratio)):
        if not 0 <= value <= 1:
            raise driver.ArgumentError(f"{name}={value} must be in [0, 1]")
    cfg = lm.config
    length = 1 + k * repeats
    if length > cfg.max_position_embeddings:
        raise driver.ArgumentError(f"the probe is {length} tokens (1 + k * repeats) but the model allows "
                                   f"{cfg.max_position_embeddings}; pass a smaller k=")
    specials = [i for i in (cfg.pad_token_id, *cfg.eos_token_ids) if i is not None]
    tokens = H.probe_tokens(cfg.vocab_size, k, repeats, cfg.bos_token_id, seed, exclude=specials)
    scores = H.head_scores(lm.model, tokens, progress=progress)
    # A NaN score would rank heads arbitrarily and silently pick the "retrieval" heads.
    require_finite(np.asarray(scores.echo), "echo scores (row = layer)", step="head")
    require_finite(np.asarray(scores.induction), "induction scores (row = layer)", step="head")
    q_mask, kv_mask = H.select_retrieval(scores, cfg.num_kv_heads, induction_ratio, echo_ratio)
    if control is not None:
        kv_mask = H.control_heads(kv_mask, control, seed)
        g = cfg.num_heads // cfg.num_kv_heads
        q_mask = np.repeat(kv_mask, g, axis=1)  # a KV head's query heads
    fields = dict(
        model=shown(lm.path), num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        position_embedding=cfg.position_embedding, probe=dict(k=k, repeats=repeats, seed=seed),
        induction_ratio=induction_ratio, echo_ratio=echo_ratio, control=control,
        echo=scores.echo, induction=scores.induction,
        retrieval_heads=q_mask, retrieval_kv_heads=kv_mask,
    )
    if cfg.position_embedding == "alibi":
        scopes = H.alibi_scopes(lm.model, eps, bound)
        fields.update(eps=eps, bound=bound, scopes=scopes, kv_scopes=H.kv_scopes(scopes, cfg.num_kv_heads))
    if duo_texts:
        # DuoAttention's head scores as kvpress computes them "on the fly", on windows of the offline held-out
        # text (kvpress samples 50 BookSum chapters from the hub), with DuoAttention's default sizes
        from kvjax.experiments.common import default_text

        ids = lm.tokenizer(default_text(), add_special_tokens=False)["input_ids"]
        length = min(duo_len, cfg.max_position_embeddings)
        step = max(length, (len(ids) - length) // duo_texts)
        rows = [ids[i:i + length] for i in range(0, len(ids) - length + 1, step)][:duo_texts]
        fields.update(duo_scores=H.duo_scores(lm.model, rows), duo_texts=len(rows), duo_len=length,
                      sink_size=128, recent_size=256)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    H.save_heads(out, **fields)
    plot = Path(plot) if plot else out.with_suffix(".png")
    H.plot_heads(scores, q_mask, plot)
    return fields | {"plot": plot}, scores


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.find_heads", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help=model_help())
    p.add_argument("--out", required=True, help="heads file to write (JSON)")
    p.add_argument("--k", type=int, default=2500, help="random tokens per repetition (paper: 2500)")
    p.add_argument("--repeats", type=int, default=4, help="repetitions of the K tokens (paper: 4)")
    p.add_argument("--seed", type=int, default=0,
                   help="the random seed of the probe's K tokens (and of --control random)")
    p.add_argument("--induction-ratio", type=float, default=0.14, help="share of heads kept by induction score")
    p.add_argument("--echo-ratio", type=float, default=0.01, help="share of heads kept by echo score")
    p.add_argument("--eps", type=float, default=1e-3, help="ALiBi: attention bound of Theorem 1")
    p.add_argument("--bound", choices=H.BOUNDS, default="paper", help="ALiBi: eq. 2 as printed, or the repaired bound")
    p.add_argument("--plot", help="PNG heatmap of the scores (default: next to --out)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the weights' and the cache's dtype")
    p.add_argument("--control", choices=["none", "random"],
                   help="RazorAttention Table 1's controls: write no protected head, or as many as the probe "
                        "finds drawn at random (--seed), instead of the retrieval heads")
    p.add_argument("--duo", type=int, default=0, metavar="N",
                   help="also write DuoAttention's head scores (duo_scores), computed on the fly as kvpress does, "
                        "on N windows of the offline text (0: none)")
    p.add_argument("--duo-len", type=int, default=1024, help="tokens per --duo window")
    add_run_args(p)
    args = p.parse_args(argv)
    for name in ("induction_ratio", "echo_ratio"):  # at parsing, before the model loads
        value = getattr(args, name)
        if not 0 <= value <= 1:
            p.error(f"--{name.replace('_', '-')}={value} must be in [0, 1]")

    lm = load(args.model, dtype=args.dtype, allow_nonfinite=args.allow_nonfinite)
    cfg = lm.config
    fields, scores = driver.call(p, find, lm, args.out, k=args.k, repeats=args.repeats, seed=args.seed,
                                 induction_ratio=args.induction_ratio, echo_ratio=args.echo_ratio, eps=args.eps,
                                 bound=args.bound, control=args.control, plot=args.plot, progress=True,
                                 duo_texts=args.duo, duo_len=args.duo_len)
    q_mask, kv_mask, plot = fields["retrieval_heads"], fields["retrieval_kv_heads"], fields["plot"]
    out, length = Path(args.out), 1 + args.k * args.repeats
    n = cfg.num_layers * cfg.num_heads
    print(f"probe    {length} tokens (BOS + {args.k} x {args.repeats}) through {cfg.num_layers} layers x {cfg.num_heads} heads")
    for name, m in (("induction", scores.induction), ("echo", scores.echo)):
        top = np.argsort(-m.reshape(-1), kind="stable")[:5]
        print(f"{name:10s}top heads (layer, head, score): " +
              ", ".join(f"({i // cfg.num_heads}, {i % cfg.num_heads}, {m.reshape(-1)[i]:.3f})" for i in top))
    print(f"retrieval {int(q_mask.sum())}/{n} query heads -> {int(kv_mask.sum())}/{cfg.num_layers * cfg.num_kv_heads} KV heads")
    if cfg.position_embedding == "alibi":
        print(f"alibi    vision scopes {int(fields['kv_scopes'].min())}..{int(fields['kv_scopes'].max())} tokens (eps {args.eps})")
    print(f"wrote    {out} and {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
