"""The decoding suite's tables and plot, from its records alone (`kvjax.experiments.decoding`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvjax.experiments import verdicts

BASELINE = "streaming"
BIN = 64  # KL is recorded as its mean over bins of this many steps (the plot's resolution)


def _by(records: list[dict]) -> dict[str, dict[int, dict]]:
    """`{label: {prompt: record}}`."""
    out: dict[str, dict[int, dict]] = {}
    for r in records:
        out.setdefault(r["label"], {})[r["prompt"]] = r
    return out


def _mean_se(values: list[float]) -> str:
    se = verdicts.paired_se(values)
    return f"{np.mean(values):.4f}" + (f" ± {se:.4f}" if se is not None else "")


def _verdict(label: str, rows: dict[int, dict], base: dict[int, dict] | None, full: dict[int, dict]) -> str:
    """Lower KL than StreamingLLM at the same ratio, paired over prompts, at matched bytes."""
    if base is None or label.startswith(BASELINE + " "):
        return ""
    shared = sorted(rows.keys() & base.keys())
    if not shared:
        return ""
    held = lambda rs: float(np.mean([rs[i]["kv_bytes"] / full[i]["kv_bytes"] for i in shared]))  # noqa: E731
    off = verdicts.unmatched(held(rows), held(base))
    if off:
        return off
    diff, se, n = verdicts.paired_gap({i: base[i]["kl"] for i in shared}, {i: rows[i]["kl"] for i in shared})
    return f"**{verdicts.verdict(diff, se, n)}** ({verdicts.evidence(diff, se, paired=True, n=n, of='prompts', digits=4)})"


def _small_sample(records: list[dict]) -> str:
    """What the verdicts' cut means at this many prompts: the rule's 2 s.e. against Student's t with n - 1 degrees of
    freedom, which a paired mean over n prompts strictly calls for."""
    from scipy import stats

    n = min((len(rows) for rows in _by(records).values()), default=0)
    if n < 2:
        return "One prompt per policy: no standard error, every verdict inconclusive."
    return (f"Verdicts: the project's rule (beyond {verdicts.SE_MULTIPLE} s.e., paired over {n} prompts, each prompt's "
            f"steps one cluster). With {n} prompts Student's t ({n - 1} degrees of freedom) would need "
            f"{stats.t.ppf(0.975, n - 1):.2f} s.e. for the same 5 % two-sided: read a verdict between the two as "
            "inconclusive.")


def table(records: list[dict]) -> tuple[str, dict]:
    """(markdown, summary): per ratio, each policy's mean KL and NLL over its prompts (± their standard error), the
    tokens its greedy output agrees with the full cache's (median), KV bytes held, decode tok/s and the verdict of
    "lower KL than StreamingLLM at the same ratio"."""
    by = _by(records)
    full = by.get("full", {})
    ratios = sorted({r["ratio"] for r in records if r["ratio"] is not None})
    machines = sorted({r["machine"] for r in records})
    lines = [f"Timings (tok/s) on {', '.join(machines)}. KL(p_full || p_policy) per step, teacher-forced on the full "
             "cache's greedy continuation; NLL gap = the policy's NLL of that continuation minus the full cache's; "
             "agree = tokens the policy's own greedy output matches before it first differs (median over prompts); "
             "KV held = the cache's K and V bytes over the full cache's. tok/s: one generation per prompt (the median "
             "of the prompts'), no repeats and no ceilings beside it: a rough figure, not a benchmark (`benchmarks/`).",
             "", _small_sample(records), ""]
    summary: dict = {}
    for ratio in [None, *ratios]:
        labels = [lab for lab in by if by[lab][next(iter(by[lab]))]["ratio"] == ratio]
        if not labels:
            continue
        lines += [f"### {'full cache' if ratio is None else f'{ratio}:1'}", "",
                  "| policy | prompts | KL (nats) | NLL gap | agree | KV held | KV MiB | tok/s | lower KL than StreamingLLM |",
                  "|---|---|---|---|---|---|---|---|---|"]
        base = by.get(f"{BASELINE} {ratio}:1")
        for lab in labels:
            rows = by[lab]
            rs = [rows[i] for i in sorted(rows)]
            held = np.mean([r["kv_bytes"] / full[r["prompt"]]["kv_bytes"] for r in rs if r["prompt"] in full])
            gap = [r["nll"] - r["nll_full"] for r in rs]
            lines.append(f"| {lab} | {len(rs)} | {_mean_se([r['kl'] for r in rs])} | {_mean_se(gap)} | "
                         f"{int(np.median([r['agree'] for r in rs]))} | {held:.3f} | "
                         f"{np.mean([r['kv_bytes'] for r in rs]) / 2**20:.2f} | {np.median([r['tok_s'] for r in rs]):.1f} | "
                         f"{_verdict(lab, rows, base, full)} |")
            summary[lab] = {"policy": rs[0]["policy"], "kl": float(np.mean([r["kl"] for r in rs])),
                            "nll_gap": float(np.mean(gap)), "agree": float(np.median([r["agree"] for r in rs])),
                            "kv_held": float(held), "tok_s": float(np.median([r["tok_s"] for r in rs]))}
        lines.append("")
    return "\n".join(lines), summary


def plot(out: Path, records: list[dict]) -> Path:
    """OUT/results.png: mean KL against position (per bin of steps), one panel per ratio, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = _by(records)
    ratios = sorted({r["ratio"] for r in records if r["ratio"] is not None}) or [None]
    fig, axes = plt.subplots(1, len(ratios), figsize=(5 * len(ratios), 3.5), squeeze=False)
    for ax, ratio in zip(axes[0], ratios):
        for lab, rows in by.items():
            if lab == "full" or next(iter(rows.values()))["ratio"] != ratio:
                continue
            curve = np.mean([r["kl_bins"] for r in rows.values()], axis=0)
            width = len(next(iter(rows.values()))["kl_bins"])
            ax.plot(np.arange(width) * BIN + BIN / 2, curve, label=lab.rsplit(" ", 1)[0])
        ax.set_yscale("log")
        ax.set_xlabel("generated token")
        ax.set_ylabel("KL(full || policy), nats")
        ax.set_title(f"{ratio}:1" if ratio else "")
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
