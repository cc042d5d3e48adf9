"""Perplexity with a bounded cache, StreamingLLM's protocol: the text is fed one token at a time, the
NLL of each next token is recorded, and the policy compresses the cache after every step.

    python -m kvjax.experiments.perplexity [--model DIR] [--text FILE] [--lengths 256,512,1024]
        [--compare full,streaming,mat] [--budget 128] [--positions rolling] [--prefill-mode chunked --chunk 512]

`--prefill-mode chunked --chunk N` reads the text N tokens at a time instead: each chunk attends the
compressed cache and itself, then is folded in (for StreamingLLM exactly the token-by-token result,
N times fewer sequential steps; SnapKV and the other prompt compressors can then be scored too).

Lengths up to the model's `max_position_embeddings` are "in window"; longer ones (MAT's Table 3,
StreamingLLM's figure 3) need `--positions rolling`, where keys are rotated by their rank in the
cache; with absolute positions such a cell is reported as not run, never extrapolated silently.
Default text: the held-out standard-library reference topics and modules (never trained on by the
default model). `--sequences N` scores N consecutive windows of each length and averages their NLL
(MAT's Table 3 averages over WikiText-2's sequences); the NLL plot shows the first.

`--anchor-grid auto` (or `--anchor-grid 1,8,16`) tunes MAT's β per budget, as the paper grid-searches it: MAT runs
at each β of the grid (`kvjax.policies.mat.default_anchor_grid`: 1 and budget/8 .. budget/2), each length's β is
the one with the lowest NLL on a tuning window (the text's window after the scored sequences, never scored), and
MAT's row gives the scored sequences at that β (each β's tuning and scored NLL in the JSON summary). The text
must then hold sequences + 1 windows of the longest length; with `--anchor-tuning leave-one-out` it needs none
more: each scored window takes the β with the lowest mean NLL on the other windows. Results:
OUT/runs.jsonl (one record per policy x length x sequence, resumable),
OUT/results.{md,csv,json}, OUT/perplexity.png (ppl vs length) and OUT/nll.png (NLL vs position).
"""

from __future__ import annotations

import argparse
import re
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from kvjax.experiments import cli, driver
from kvjax.experiments.records import write_csv_atomic
from kvjax.experiments.common import (
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
from kvjax import drive
from kvjax.errors import InvalidInput
from kvjax.policies import AnchorCache, ByLayer
from kvjax.policies.mat import default_anchor_grid
from kvjax.scoring import logprobs, logprobs_rows
from kvjax.cli import HelpFormatter


def heldout_text() -> str:
    from kvjax.experiments import corpus

    docs = [t for _, t in corpus.doc_documents("heldout")] + [t for _, t in corpus.code_documents("heldout")]
    return "\n\n".join(docs)


def beyond_window(plan, length: int, max_pos: int) -> bool:
    """Whether scoring `length` tokens under a policy (its `plan`, `kvjax.drive.plan(model, policy)`) would put absolute
    positions past the trained window."""
    return plan.absolute and length > max_pos


def measure(model, ids: list[int], policy) -> dict:
    return nll_record(logprobs(model, ids, policy))


def nll_record(lp: np.ndarray) -> dict:
    """The record of one window's log-probabilities."""
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


def anchor_variants(policy, grid: Sequence[int] | str) -> dict[int, ByLayer]:
    """MAT `policy` (a ByLayer over an AnchorCache) at each β of `grid` ("auto": `default_anchor_grid` of its
    budget), everything else as given."""
    if not (isinstance(policy, ByLayer) and isinstance(policy.deep, AnchorCache)):
        raise InvalidInput(f"anchor_grid: {policy.describe()} is not MAT")
    if grid == "auto":
        if policy.deep.budget is None:
            raise InvalidInput("anchor_grid=auto: MAT at a ratio has no budget to take the grid from; give the β "
                               "values (anchor_grid=1,8,16)")
        grid = default_anchor_grid(policy.deep.budget)
    # ascending, so that a tie goes to the smallest β wherever the choice is made (the run, the report page)
    return {b: dataclasses.replace(policy, deep=dataclasses.replace(policy.deep, anchor_slots=b)) for b in sorted(set(grid))}


def leave_one_out(nll: Mapping[int, Sequence[float]]) -> list[int]:
    """Per window i, the β of `nll` ({β: NLL of each window}) with the lowest mean NLL over the other windows
    (ties: the first β given)."""
    n = len(next(iter(nll.values())))
    return [min(nll, key=lambda b: (sum(nll[b]) - nll[b][i]) / (n - 1)) for i in range(n)]


def suite(lm, policies, out, *, lengths: list[int] | None = None, sequences: int = 1, text: list[str] | None = None,
          anchor_grid: Sequence[int] | str | None = None, anchor_tuning: str = "next-window", batch: int = 8,
          progress: bool = True) -> driver.SuiteResult:
    """Perplexity of each policy (`{label: policy}`, a list or one) at each length, token by token,
    into `out`; summary `{"ppl": {label: {length: ppl or None}}, "nll_per_sequence": {label: {length: [nll, ...]}},
    "policies": ...}`. `lengths` default
    to max/2, max, 2 max; `text` to the held-out standard-library text; `sequences` windows of each
    length are averaged. `anchor_grid` ("auto" or β values): MAT's β chosen per length, by `anchor_tuning`:
    "next-window", the lowest NLL on a tuning window (the window after the scored ones, never scored), the
    summary's "anchor_grid" giving `{label: {length: {"chosen": β, "tuning_nll": {β: nll}, "nll": {β: mean
    scored nll}}}}`; or "leave-one-out", each scored window at the β with the lowest mean NLL on the other
    windows (no extra window; "chosen" is then one β per window). The windows of one policy and length are
    read `batch` at a time, one row each (`kvjax.scoring.logprobs_rows`)."""
    cfg = lm.model.cfg  # the contract's: any model
    n = cfg.max_position_embeddings
    lengths = list(lengths or [n // 2, n, 2 * n])
    if min(lengths) < 2:
        raise driver.ArgumentError(f"lengths={lengths}: each must be >= 2 tokens")
    driver.positive(batch, "batch")
    if anchor_tuning not in TUNINGS:
        raise driver.ArgumentError(f"anchor_tuning={anchor_tuning!r}: one of {', '.join(TUNINGS)}")
    if anchor_tuning != "next-window" and anchor_grid is None:
        raise driver.ArgumentError(f"anchor_tuning={anchor_tuning}: no anchor_grid to tune")
    if anchor_tuning == "leave-one-out" and sequences < 2:
        raise driver.ArgumentError(f"anchor_tuning=leave-one-out: sequences={sequences}, it needs at least 2")
    ids = lm.tokenizer(read_text(text) if text else heldout_text())["input_ids"]
    extra = anchor_grid is not None and anchor_tuning == "next-window"  # the tuning window after the scored ones
    windows = sequences + extra
    if len(ids) < max(lengths) * windows:
        raise driver.ArgumentError(f"the text has {len(ids)} tokens, fewer than {windows} windows (sequences="
                                   f"{sequences}{' + 1 to tune anchor_grid' if windows > sequences else ''}) x "
                                   f"the longest lengths={max(lengths)}")
    policies = driver.labelled(policies)
    key = lambda pol, L, i: f"{pol.describe()}|{L}" + (f"|{i}" if i else "")  # noqa: E731  (sequence 0: as before)
    tuned = {}  # {label: {β: policy}}: MAT's labels, each run at every β of the grid
    if anchor_grid is not None:
        tuned = {lab: anchor_variants(pol, anchor_grid) for lab, pol in policies.items()
                 if isinstance(pol, ByLayer) and isinstance(pol.deep, AnchorCache)}
        if not tuned:
            raise driver.ArgumentError(f"anchor_grid={anchor_grid}: no MAT policy among {', '.join(policies)} to "
                                       "tune")

    def run(cells: list) -> list[dict]:
        # one policy and one length (`batches`): its windows are the rows of one batch
        _, pol, L, _ = cells[0]
        recs = [{"id": key(pol, L, i), "label": lab, "policy": pol.describe(), "length": L, "sequence": i}
                for lab, pol, L, i in cells]
        if beyond_window(drive.plan(lm.model, pol), L, n):
            return [r | {"skipped": f"absolute positions beyond max_position_embeddings={n}"} for r in recs]
        lps = logprobs_rows(lm.model, [ids[i * L : (i + 1) * L] for *_, i in cells], pol)
        return [r | nll_record(lp) for r, lp in zip(recs, lps)]

    def scored(done, lab, pol, L) -> dict:
        runs = [done[key(pol, L, i)] for i in range(sequences)]
        if any("skipped" in r for r in runs):
            return runs[0] | {"label": lab}
        nll = float(np.mean([r["nll"] for r in runs]))  # equal lengths: the token-weighted mean
        return runs[0] | {"label": lab, "nll": nll, "ppl": float(np.exp(nll)), "sequences": len(runs),
                          "ppl_per_sequence": [r["ppl"] for r in runs]}

    def left_out(done, lab, L, grid) -> dict:
        """MAT's record at length L, each window scored at the β that the other windows chose."""
        nll = {b: [done[key(p, L, i)]["nll"] for i in range(sequences)] for b, p in tuned[lab].items()}
        chosen = leave_one_out(nll)
        per = [nll[b][i] for i, b in enumerate(chosen)]
        grid[str(L)] = {"chosen": chosen, "nll": {str(b): float(np.mean(v)) for b, v in nll.items()}}
        first = done[key(tuned[lab][chosen[0]], L, 0)]
        return first | {"label": lab, "nll": float(np.mean(per)), "ppl": float(np.exp(np.mean(per))),
                        "sequences": sequences, "ppl_per_sequence": [float(np.exp(x)) for x in per],
                        "policy": re.sub(r"anchor_slots=\d+", f"anchor_slots={chosen} (leave-one-out)",
                                         first["policy"]),
                        "anchor_slots": chosen}

    def report(log):
        done = {r["id"]: r for r in log}
        records, grid = [], {}
        for lab, pol in policies.items():
            for L in lengths:
                if lab not in tuned:
                    records.append(scored(done, lab, pol, L))
                    continue
                if any("skipped" in done[key(p, L, 0)] for p in tuned[lab].values()):
                    records.append(scored(done, lab, pol, L))  # skipped at every β alike
                    continue
                if anchor_tuning == "leave-one-out":
                    records.append(left_out(done, lab, L, grid.setdefault(lab, {})))
                    continue
                tune = {b: done[key(p, L, sequences)] for b, p in tuned[lab].items()}
                best = min(tune, key=lambda b: tune[b]["nll"])
                records.append(scored(done, lab, tuned[lab][best], L) | {"anchor_slots": best})
                grid.setdefault(lab, {})[str(L)] = {
                    "chosen": best, "tuning_nll": {str(b): r["nll"] for b, r in tune.items()},
                    "nll": {str(b): scored(done, lab, p, L)["nll"] for b, p in tuned[lab].items()}}
        table, summary, figures = write_report(Path(out), records, list(policies), lengths, n)
        if grid and anchor_tuning == "leave-one-out":
            table += ("\n\nMAT's β per length and window, the lowest mean NLL on the other windows (leave-one-out; "
                      "no window is scored at a β chosen on it): " + "; ".join(
                          f"{lab} at {L}: β = {', '.join(map(str, g['chosen']))}" for lab, by in grid.items()
                          for L, g in by.items()))
            summary["anchor_grid"] = grid
        elif grid:
            table += "\n\nMAT's β per length, the lowest NLL on the tuning window (never scored): " + "; ".join(
                f"{lab} at {L}: β = {g['chosen']} (tuning NLL " + ", ".join(
                    f"β {b}: {v:.4f}" for b, v in g["tuning_nll"].items()) + ")"
                for lab, by in grid.items() for L, g in by.items())
            summary["anchor_grid"] = grid
        return table, summary, figures

    def runs_of(lab, pol) -> list:
        if lab not in tuned:
            return [(pol, i) for i in range(sequences)]
        return [(p, i) for p in tuned[lab].values() for i in range(sequences + extra)]

    cells = [(lab, p, L, i) for lab, pol in policies.items() for L in lengths for p, i in runs_of(lab, pol)]
    suite = driver.Suite("perplexity", "runs.jsonl", cells, lambda cell: key(*cell[1:]), run, report,
                         lambda todo: driver.batches(todo, batch, group=lambda c: key(c[1], c[2], 0)))
    grid_option = None if anchor_grid is None else (anchor_grid if isinstance(anchor_grid, str) else list(anchor_grid))
    options = {"text": text, "anchor_grid": grid_option, "batch": batch}
    if anchor_tuning != "next-window":  # absent otherwise: the records of runs before it existed resume
        options["anchor_tuning"] = anchor_tuning
    return driver.run_suite(suite, out, lm, options, policies, progress=progress, files=("text",))


TUNINGS = ("next-window", "leave-one-out")


def anchor_grid_arg(text: str) -> list[int] | str:
    if text == "auto":
        return text
    values = int_list(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text}: 'auto' or positive anchor counts")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.perplexity", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", help=model_help("the embedded default model"))
    p.add_argument("--text", nargs="*", help="text files (default: held-out standard-library text)")
    p.add_argument("--lengths", type=int_list, help="comma-separated token counts (default: max/2, max, 2 max)")
    p.add_argument("--sequences", type=positive_int, default=1,
                   help="consecutive windows of each length, their NLL averaged (MAT Table 3 averages many)")
    p.add_argument("--anchor-grid", type=anchor_grid_arg,
                   help="tune MAT's beta per length as --anchor-tuning says: 'auto' (1 and budget/8 .. budget/2, as "
                        "the paper's grid) or comma-separated values")
    p.add_argument("--anchor-tuning", choices=TUNINGS, default="next-window",
                   help="how --anchor-grid picks beta: on the window after the scored ones (next-window), or per "
                        "scored window on the others (leave-one-out: no extra window; it needs --sequences >= 2)")
    p.add_argument("--batch", type=positive_int, default=8,
                   help="windows of one policy and length read together, one row each (float rounding aside, the "
                        "same numbers as --batch 1)")
    p.add_argument("--out", default="results/perplexity",
                   help="where the results go (a folder; a rerun with the same options resumes there)")
    add_compare_args(p, default="full,streaming,mat")
    add_run_args(p)
    args = p.parse_args(argv)

    lm = suite_model(args)
    refuse_trained_text(args.gate_params, args.text, "--text")  # the default text: the held-out topics and modules
    res = driver.call(p, suite, lm, compared(p, args, lm.config.num_layers, lm.path), args.out, lengths=args.lengths,
                      sequences=args.sequences, text=args.text, anchor_grid=args.anchor_grid,
                      anchor_tuning=args.anchor_tuning, batch=args.batch)
    print(res.table)
    print(f"wrote {res.out}/results.{{md,csv,json}}, perplexity.png")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
