"""Perplexity with a bounded cache, StreamingLLM's protocol: the text is fed one token at a time, the
NLL of each next token is recorded, and the policy compresses the cache after every step.

    python -m experiments.perplexity [--model DIR] [--text FILE] [--lengths 256,512,1024]
        [--compare full,streaming,mat] [--budget 128] [--positions rolling] [--prefill-mode chunked --chunk 512]

`--prefill-mode chunked --chunk N` reads the text N tokens at a time instead: each chunk attends the
compressed cache and itself, then is folded in (for StreamingLLM exactly the token-by-token result,
N times fewer sequential steps; SnapKV and the other prompt compressors can then be scored too).

Lengths up to the model's `max_position_embeddings` are "in window"; longer ones (MAT's Table 3,
StreamingLLM's figure 3) need `--positions rolling`, where keys are rotated by their rank in the
cache; with absolute positions such a cell is reported as not run, never extrapolated silently.
Default text: the held-out standard-library reference topics and modules (never trained on by the
default model). `--sequences N` scores N consecutive windows of each length and averages their NLL
(MAT's Table 3 averages over WikiText-2's sequences); the NLL plot shows the first. Results:
OUT/runs.jsonl (one record per policy x length x sequence, resumable),
OUT/results.{md,csv,json}, OUT/perplexity.png (ppl vs length) and OUT/nll.png (NLL vs position).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from experiments import cli
from experiments.common import (
    add_compare_args,
    add_run_args,
    attach_gate_params,
    chosen_policies,
    int_list,
    positive_int,
    read_text,
    resolve_model,
)
from experiments.records import ResultLog, claim_results_dir, options_of
from kvjax.scoring import logprobs


def heldout_text() -> str:
    from experiments import corpus

    docs = [t for _, t in corpus.doc_documents("heldout")] + [t for _, t in corpus.code_documents("heldout")]
    return "\n\n".join(docs)


def beyond_window(policy, num_layers: int, length: int, max_pos: int) -> bool:
    """Whether scoring `length` tokens would put absolute positions past the trained window."""
    absolute = any(policy.position_mode(i) == "absolute" for i in range(num_layers))
    return absolute and length > max_pos


def measure(model, ids: list[int], policy) -> dict:
    lp = logprobs(model, ids, policy)
    return {"nll": float(-lp.mean()), "ppl": float(np.exp(-lp.mean())), "nll_per_token": (-lp).round(5).tolist()}


def write_report(out: Path, records: list[dict], labels: list[str], lengths: list[int], max_pos: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cell = {(r["label"], r["length"]): r for r in records}
    lines = ["| policy | " + " | ".join(f"{n}{'*' if n > max_pos else ''}" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    table = {}
    for lab in labels:
        row = []
        for n in lengths:
            r = cell.get((lab, n))
            row.append(None if r is None or "ppl" not in r else round(r["ppl"], 3))
        table[lab] = dict(zip(map(str, lengths), row))
        lines.append(f"| {lab} | " + " | ".join("n/a" if v is None else f"{v:.3f}" for v in row) + " |")
    lines += ["", f"\\* beyond the model's max_position_embeddings = {max_pos} (needs rolling positions); "
              "n/a: absolute positions would extrapolate, not run."]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"ppl": table, "policies": {r["label"]: r["policy"] for r in records}},
                                                 indent=2))
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["policy", *lengths])
        for lab in labels:
            w.writerow([lab, *(table[lab][str(n)] for n in lengths)])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    for lab in labels:
        pts = [(n, table[lab][str(n)]) for n in lengths if table[lab][str(n)] is not None]
        if pts:
            a.plot(*zip(*pts), marker="o", label=lab)
        longest = max((cell[(lab, n)] for n in lengths if (lab, n) in cell and "ppl" in cell[(lab, n)]),
                      key=lambda r: r["length"], default=None)
        if longest is not None:
            nll = np.asarray(longest["nll_per_token"])
            k = max(1, len(nll) // 64)  # a moving average keeps the curve readable
            b.plot(np.arange(len(nll) - k + 1) + k, np.convolve(nll, np.ones(k) / k, "valid"), label=lab, lw=1)
    a.axvline(max_pos, color="grey", ls=":", lw=1)
    b.axvline(max_pos, color="grey", ls=":", lw=1)
    a.set(xlabel="tokens", ylabel="perplexity", xscale="log", yscale="log")
    b.set(xlabel="position", ylabel="NLL (moving average)")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "perplexity.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.perplexity", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="local Hugging Face directory (default: the embedded default model)")
    p.add_argument("--text", nargs="*", help="text files (default: held-out standard-library text)")
    p.add_argument("--lengths", type=int_list, help="comma-separated token counts (default: max/2, max, 2 max)")
    p.add_argument("--sequences", type=positive_int, default=1,
                   help="consecutive windows of each length, their NLL averaged (MAT Table 3 averages many)")
    p.add_argument("--out", default="results/perplexity")
    add_compare_args(p, default="full,streaming,mat")
    add_run_args(p)
    args = p.parse_args(argv)

    lm = resolve_model(p, args.model, allow_nonfinite=args.allow_nonfinite)
    attach_gate_params(args, lm.model)
    cfg = lm.config
    labels, policies = chosen_policies(p, args, cfg.num_layers)
    n = cfg.max_position_embeddings
    lengths = args.lengths or [n // 2, n, 2 * n]
    if min(lengths) < 2:
        p.error(f"--lengths {lengths}: each must be >= 2 tokens")
    text = read_text(args.text) if args.text else heldout_text()
    ids = lm.tokenizer(text)["input_ids"]
    if len(ids) < max(lengths) * args.sequences:
        p.error(f"the text has {len(ids)} tokens, fewer than --sequences {args.sequences} x the longest --lengths "
                f"{max(lengths)}")
    out = Path(args.out)
    # No resuming over another configuration's records.
    claim_results_dir(out, lm, options_of(args, files=("text",), selection=("lengths", "sequences")))
    log = ResultLog(out / "runs.jsonl")
    key = lambda pol, L, i: f"{pol.describe()}|{L}" + (f"|{i}" if i else "")  # noqa: E731  (sequence 0: as before)
    todo = [(lab, pol, L, i) for lab, pol in zip(labels, policies) for L in lengths for i in range(args.sequences)
            if key(pol, L, i) not in log]
    for lab, pol, L, i in tqdm(todo, desc="perplexity"):
        rec = {"id": key(pol, L, i), "label": lab, "policy": pol.describe(), "length": L, "sequence": i}
        if beyond_window(pol, cfg.num_layers, L, n):
            rec["skipped"] = f"absolute positions beyond max_position_embeddings={n}"
        else:
            rec |= measure(lm.model, ids[i * L : (i + 1) * L], pol)
        log.add(rec)
    done = {r["id"]: r for r in log}
    records = []
    for lab, pol in zip(labels, policies):
        for L in lengths:
            runs = [done[key(pol, L, i)] for i in range(args.sequences)]
            if any("skipped" in r for r in runs):
                records.append(runs[0] | {"label": lab})
                continue
            nll = float(np.mean([r["nll"] for r in runs]))  # equal lengths: the token-weighted mean
            records.append(runs[0] | {"label": lab, "nll": nll, "ppl": float(np.exp(nll)), "sequences": len(runs),
                                      "ppl_per_sequence": [r["ppl"] for r in runs]})
    write_report(out, records, labels, lengths, n)
    print((out / "results.md").read_text())
    print(f"wrote {out}/results.{{md,csv,json}}, perplexity.png")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
