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
import sys
from pathlib import Path

import numpy as np

from experiments import cli, driver
from experiments.records import write_csv_atomic
from experiments.common import (
    add_compare_args,
    add_run_args,
    compared,
    int_list,
    model_help,
    positive_int,
    read_text,
    refuse_trained_text,
    suite_model,
)
from kvjax.scoring import logprobs
from kvjax import drive


def heldout_text() -> str:
    from experiments import corpus

    docs = [t for _, t in corpus.doc_documents("heldout")] + [t for _, t in corpus.code_documents("heldout")]
    return "\n\n".join(docs)


def beyond_window(plan, length: int, max_pos: int) -> bool:
    """Whether scoring `length` tokens under a policy (its `plan`, `kvjax.drive.plan(model, policy)`) would put absolute
    positions past the trained window."""
    return plan.absolute and length > max_pos


def measure(model, ids: list[int], policy) -> dict:
    lp = logprobs(model, ids, policy)
    return {"nll": float(-lp.mean()), "ppl": float(np.exp(-lp.mean())), "nll_per_token": (-lp).round(5).tolist()}


def write_report(out: Path, records: list[dict], labels: list[str], lengths: list[int], max_pos: int
                 ) -> tuple[str, dict, list[Path]]:
    """(markdown, JSON summary, figures): the perplexity table, OUT/results.csv, and the two plots."""
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
    out.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(out / "results.csv", [["policy", *lengths]]
                     + [[lab, *(table[lab][str(n)] for n in lengths)] for lab in labels])
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
    # each sequence's NLL, so that a comparison of two policies has a standard error over sequences
    nll_seq = {lab: {str(n): [float(np.log(x)) for x in cell[(lab, n)].get("ppl_per_sequence") or []]
                     for n in lengths if (lab, n) in cell and "ppl" in cell[(lab, n)]} for lab in labels}
    summary = {"ppl": table, "nll_per_sequence": nll_seq, "policies": {r["label"]: r["policy"] for r in records}}
    return "\n".join(lines), summary, [out / "perplexity.png"]


def suite(lm, policies, out, *, lengths: list[int] | None = None, sequences: int = 1, text: list[str] | None = None,
          progress: bool = True) -> driver.SuiteResult:
    """Perplexity of each policy (`{label: policy}`, a list or one) at each length, token by token,
    into `out`; summary `{"ppl": {label: {length: ppl or None}}, "nll_per_sequence": {label: {length: [nll, ...]}},
    "policies": ...}`. `lengths` default
    to max/2, max, 2 max; `text` to the held-out standard-library text; `sequences` windows of each
    length are averaged."""
    cfg = lm.config
    n = cfg.max_position_embeddings
    lengths = list(lengths or [n // 2, n, 2 * n])
    if min(lengths) < 2:
        raise driver.ArgumentError(f"lengths={lengths}: each must be >= 2 tokens")
    ids = lm.tokenizer(read_text(text) if text else heldout_text())["input_ids"]
    if len(ids) < max(lengths) * sequences:
        raise driver.ArgumentError(f"the text has {len(ids)} tokens, fewer than sequences={sequences} x the longest "
                                   f"lengths={max(lengths)}")
    policies = driver.labelled(policies)
    key = lambda pol, L, i: f"{pol.describe()}|{L}" + (f"|{i}" if i else "")  # noqa: E731  (sequence 0: as before)

    def run(cell: list) -> list[dict]:
        (lab, pol, L, i), = cell
        rec = {"id": key(pol, L, i), "label": lab, "policy": pol.describe(), "length": L, "sequence": i}
        if beyond_window(drive.plan(lm.model, pol), L, n):
            rec["skipped"] = f"absolute positions beyond max_position_embeddings={n}"
        else:
            rec |= measure(lm.model, ids[i * L : (i + 1) * L], pol)
        return [rec]

    def report(log):
        done = {r["id"]: r for r in log}
        records = []
        for lab, pol in policies.items():
            for L in lengths:
                runs = [done[key(pol, L, i)] for i in range(sequences)]
                if any("skipped" in r for r in runs):
                    records.append(runs[0] | {"label": lab})
                    continue
                nll = float(np.mean([r["nll"] for r in runs]))  # equal lengths: the token-weighted mean
                records.append(runs[0] | {"label": lab, "nll": nll, "ppl": float(np.exp(nll)), "sequences": len(runs),
                                          "ppl_per_sequence": [r["ppl"] for r in runs]})
        return write_report(Path(out), records, list(policies), lengths, n)

    cells = [(lab, pol, L, i) for lab, pol in policies.items() for L in lengths for i in range(sequences)]
    suite = driver.Suite("perplexity", "runs.jsonl", cells, lambda cell: key(*cell[1:]), run, report)
    return driver.run_suite(suite, out, lm, {"text": text}, policies, progress=progress, files=("text",))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.perplexity", description=cli.description(__doc__))
    p.add_argument("--model", help=model_help("the embedded default model"))
    p.add_argument("--text", nargs="*", help="text files (default: held-out standard-library text)")
    p.add_argument("--lengths", type=int_list, help="comma-separated token counts (default: max/2, max, 2 max)")
    p.add_argument("--sequences", type=positive_int, default=1,
                   help="consecutive windows of each length, their NLL averaged (MAT Table 3 averages many)")
    p.add_argument("--out", default="results/perplexity")
    add_compare_args(p, default="full,streaming,mat")
    add_run_args(p)
    args = p.parse_args(argv)

    lm = suite_model(args)
    refuse_trained_text(args.gate_params, args.text, "--text")  # the default text: the held-out topics and modules
    res = driver.call(p, suite, lm, compared(p, args, lm.config.num_layers, lm.path), args.out, lengths=args.lengths,
                      sequences=args.sequences, text=args.text)
    print(res.table)
    print(f"wrote {res.out}/results.{{md,csv,json}}, perplexity.png")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
