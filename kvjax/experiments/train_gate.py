"""Training Attention-Gates: continual pre-training (gates only) or fine-tuning (LoRA + gates).

    python -m kvjax.experiments.train_gate --model DIR --mode cpt --out DIR [--data a.txt ...] [--steps 200]
    python -m kvjax.experiments.train_gate --model DIR --mode sft --out DIR [--sft-data items.jsonl] [--lora-rank 8]

CPT (Section 4.1): the base model is frozen and only the gates learn, from text windows
(default: Python's own documentation, `pydoc_data.topics`, so it runs offline), never its held-out
part (`kvjax.experiments.common.split_text`: the held-out topics of the default text, or the last fifth of
--data), from which `kvjax.experiments.eval_gate` takes its windows. SFT (Section 4.2): LoRA on q/k/v/o plus the gates,
on JSON lines `{"prompt": ..., "answer": ...}` with the LM loss on the answer tokens
(default: the built-in fact-retrieval task of `kvjax.experiments.eval_anllm`); the adapters are
merged and the model is saved to OUT/model.

The loss is the LM loss plus eq. 1's `alpha * |mean(AG) - beta|`; `--preset` picks the
paper's hyper-parameters (cpt: tau 0.5, gamma 2, alpha 5, beta 0.4; sft: tau 0.3, gamma 0,
alpha 1, beta 0.28), each overridable. The gates are written to OUT (gate.json,
gate.safetensors: `--gate-params OUT`); a killed run resumes from OUT/training. CPT ends
with `kvjax.experiments.eval_gate`'s report in OUT/eval (eviction per layer and head, held-out
loss, the baselines at the same eviction ratio).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from kvjax.experiments import cli, driver, eval_gate
from kvjax.experiments.common import SPLIT_RULE, add_run_args, model_help, training_windows
from kvjax.experiments.records import training_identity
from kvjax.experiments.eval_anllm import fact_task
from kvjax.errors import InvalidInput
from kvjax.gate import PRESETS, attach_gates, eviction_loss, save_gates, without_gates
from kvjax.lora import LORA_PATTERN, attach_lora, merge_lora
from kvjax.train import TrainConfig, next_token_loss, train
from kvjax import drive
from kvjax.models.loading import save_pretrained
from kvjax.cli import HelpFormatter

GATE_PATTERN = r"self_attn/gate/"

CPT_LR = 1e-3  # only the gates train: a small module from scratch takes a large rate
SFT_LR = 5e-5  # the paper's SFT rate (sec. 4.2: AdamW, lr 5e-5, LoRA + gates)


def sft_records(path: str | None, n: int, seed: int) -> list[dict]:
    if path:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        bad = [i for i, r in enumerate(rows) if not {"prompt", "answer"} <= set(r)]
        if bad:
            raise InvalidInput(f"{path}: line {bad[0] + 1} lacks 'prompt' or 'answer'")
        return rows
    rows = []
    for i in range(n):
        demos, items = fact_task(1, 4, 4, seed + i)
        it = items[0]
        rows.append({"prompt": " ".join(demos) + it["query"], "answer": it["options"][it["answer"]]})
    return rows


def sft_arrays(tok, rows: list[dict], seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-padded tokens, positions (-1 on padding) and loss weights (1 on answer tokens)."""
    toks = np.zeros((len(rows), seq_len), np.int32)
    pos = np.full((len(rows), seq_len), -1, np.int32)
    w = np.zeros((len(rows), seq_len), np.float32)
    for i, r in enumerate(rows):
        p = tok(r["prompt"])["input_ids"]
        a = tok(r["answer"], add_special_tokens=False)["input_ids"]
        if len(p) + len(a) > seq_len:
            raise InvalidInput(f"record {i} is {len(p) + len(a)} tokens, more than --seq-len={seq_len}")
        n = len(p) + len(a)
        toks[i, :n], pos[i, :n], w[i, len(p) : n] = p + a, np.arange(n), 1.0
    return toks, pos, w


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.train_gate", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help=model_help())
    p.add_argument("--mode", choices=["cpt", "sft"], required=True,
                   help="cpt: the gates alone learn, from text (Section 4.1); sft: LoRA and the gates, on "
                        "prompt / answer items (Section 4.2)")
    p.add_argument("--out", required=True,
                   help="where the gates go (--gate-params OUT; sft: the merged model in OUT/model); a killed run "
                        "resumes from OUT/training")
    p.add_argument("--data", nargs="*", help="CPT: text files (default: pydoc_data.topics)")
    p.add_argument("--sft-data", help="SFT: JSON lines with prompt / answer (default: the fact task)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="hyper-parameters (default: the --mode's)")
    for name in ("tau", "gamma", "alpha", "beta"):
        p.add_argument(f"--{name}", type=float,
                       help={"tau": "eq. 6's threshold tau: a token is kept if sigmoid(logit + gamma) > tau, in (0, 1)",
                             "gamma": "eq. 6's offset gamma >= 0 on the gate's logit (large: keep probabilities start "
                                      "near 1)",
                             "alpha": "eq. 1's weight alpha of the eviction loss alpha * |mean(AG) - beta|",
                             "beta": "eq. 1's target mean keep flag beta, in [0, tau]"}[name]
                       + " (default: the --preset's)")
    p.add_argument("--gate-heads", type=int, default=4, help="h'")
    p.add_argument("--gate-head-dim", type=int, help="d'_k (default: the model's head_dim)")
    p.add_argument("--lora-rank", type=int, default=8, help="SFT: the rank r of the LoRA adapters on q/k/v/o")
    p.add_argument("--lora-alpha", type=float, default=16.0,
                   help="SFT: LoRA's alpha (the update is scaled by alpha / r)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--lr", type=float, help="default by --mode: cpt 1e-3 (only the small gates train: a large rate); "
                                            "sft 5e-5, the paper's (sec. 4.2, AdamW)")
    p.add_argument("--warmup", type=int, default=10, help="steps of linear learning-rate warm-up from 0")
    p.add_argument("--seq-len", type=int, default=256,
                   help="tokens per training row (CPT: a text window; SFT: prompt + answer, padded)")
    p.add_argument("--batch", type=int, default=4, help="rows per optimizer step")
    p.add_argument("--eval-windows", type=int, default=16,
                   help="CPT: windows of the held-out text (never trained on) the closing evaluation scores")
    p.add_argument("--sft-items", type=int, default=256, help="SFT without --sft-data: items of the built-in fact task")
    p.add_argument("--save-every", type=int, default=50,
                   help="steps between checkpoints in OUT/training (a killed run resumes from the last)")
    p.add_argument("--seed", type=int, default=0,
                   help="the random seed of the gates' and LoRA's initialisation, the row order and the fact task")
    add_run_args(p)
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = SFT_LR if args.mode == "sft" else CPT_LR

    lm = driver.load_model(args.model, allow_nonfinite=args.allow_nonfinite)
    model, tok = lm.model, lm.tokenizer
    overrides = {k: getattr(args, k) for k in ("tau", "gamma", "alpha", "beta") if getattr(args, k) is not None}
    cfg = dataclasses.replace(PRESETS[args.preset or args.mode], heads=args.gate_heads,
                              head_dim=args.gate_head_dim, **overrides)
    attach_gates(model, cfg, seed=args.seed)
    trainable = (GATE_PATTERN,)
    if args.mode == "sft":
        attach_lora(model, args.lora_rank, args.lora_alpha, seed=args.seed)
        trainable += (LORA_PATTERN,)
        toks, pos, weights = sft_arrays(tok, sft_records(args.sft_data, args.sft_items, args.seed), args.seq_len)
    else:
        # the closing evaluation's windows first: a count the held-out text cannot hold fails before training
        held = eval_gate.held_out(tok, args.data, args.seq_len, args.eval_windows, "--eval-windows")
        toks = training_windows(tok, args.data, args.seq_len)
        pos = np.broadcast_to(np.arange(args.seq_len, dtype=np.int32), toks.shape)
        weights = np.ones(toks.shape, np.float32)
    order = np.random.default_rng(args.seed).permutation(len(toks))

    def batch(i):  # a pure function of the micro-batch index: resuming replays nothing
        rows = order[(np.arange(args.batch) + i * args.batch) % len(order)]
        return {"tokens": jnp.asarray(toks[rows]), "pos": jnp.asarray(pos[rows]), "w": jnp.asarray(weights[rows])}

    def loss(m, b):
        logits, flags = drive.forward(m, b["tokens"], b["pos"])
        lm_loss = next_token_loss(logits, b["tokens"], b["w"])
        evict, kept = eviction_loss(flags, b["pos"] >= 0, cfg)
        return lm_loss + evict, {"lm_loss": lm_loss, "kept": kept}

    out = Path(args.out)
    tcfg = TrainConfig(steps=args.steps, lr=args.lr, warmup=args.warmup, trainable=trainable,
                       save_every=args.save_every)
    result = train(model, batch, loss, tcfg, out / "training",
                   identity=training_identity(args, models=("model",), files=("data", "sft_data"),
                                              skip=("steps",))
                   | ({"held-out text": SPLIT_RULE} if args.mode == "cpt" else {}))
    save_gates(result.model, out)
    h = result.history
    print(f"trained  {len(h)} steps ({args.mode}, {cfg}); lm loss {h[0]['lm_loss']:.3f} -> {h[-1]['lm_loss']:.3f}, "
          f"kept {h[0]['kept']:.2f} -> {h[-1]['kept']:.2f}")
    if args.mode == "sft":
        merge_lora(result.model)
        with without_gates(result.model):
            save_pretrained(result.model, out / "model", tokenizer=tok)
        print(f"wrote    {out / 'model'} (LoRA merged) and the gates in {out} (--gate-params)")
        return 0
    print(f"wrote    the gates in {out} (--gate-params) and {out / 'training' / 'loss.png'}")
    eval_gate.write_report(out / "eval", eval_gate.evaluate(result.model, held))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
