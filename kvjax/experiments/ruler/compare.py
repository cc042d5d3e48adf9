"""RULER records compared sample by sample: the tables and verdicts a report draws from a run's `preds.jsonl`.

Two policies of one run read the same prompts, so a comparison of them is paired: each prompt's score under one
minus its score under the other, and the standard error of that mean (`kvjax.experiments.verdicts.paired_gap`). A
verdict on SlimKV's claim (SlimKV >= SnapKV, its eqs. 3-5 against SnapKV's score) is given only for a pair whose
observation window, pooling kernel and pooling agree (read from the records' policy descriptions), so that the
score is the only difference (issue 65: SnapKV max-pooled against SlimKV avg-pooled measured the pooling). A pair
that differs in those is shown with its numbers and what differs, and no verdict.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvjax.experiments.records import read_records
from kvjax.experiments.verdicts import evidence, paired_gap, verdict

Key = tuple[str, int, int]  # (task, length, sample index)
# what SnapKV's and SlimKV's scores are pooled by: a comparison of the two is matched when these agree
SETTINGS = ("observation_window", "kernel", "pool")


def read(run: str | Path) -> list[dict]:
    """The records of a RULER run directory (its preds.jsonl)."""
    return read_records(Path(run) / "preds.jsonl", "RULER")


def scores(rows: list[dict], label: str) -> dict[Key, float]:
    """`{(task, length, index): score}` of `label`'s records."""
    return {(r["task"], r["length"], r["index"]): float(r["score"]) for r in rows if r["label"] == label}


def split_label(label: str) -> tuple[str, float | None]:
    """("snapkv", 0.5) for "snapkv@0.5"; (label, None) for a label without a ratio ("full")."""
    name, at, ratio = label.rpartition("@")
    return (name, float(ratio)) if at else (label, None)


def settings(description: str) -> dict[str, str]:
    """The pooling settings (`SETTINGS`) a policy description names, e.g. {"observation_window": "32",
    "kernel": "7", "pool": "'max'"}; the outermost policy's where a description nests one (AdaKV's scorer)."""
    found = {}
    for name in SETTINGS:
        m = re.search(rf"\b{name}=('[^']*'|[^,)]*)", description)
        if m:
            found[name] = m.group(1)
    return found


def family(description: str) -> str:
    """The policy class a description opens with ("SnapKV" for "SnapKV(budget=None, ...)")."""
    return description.split("(", 1)[0]


def _described(rows: list[dict]) -> dict[str, str]:
    return {r["label"]: r["policy"] for r in rows}


def _settings_text(s: dict[str, str]) -> str:
    return ", ".join(f"{k} {v.strip(chr(39))}" for k, v in s.items())


def slimkv_claims(rows: list[dict]) -> list[str]:
    """SlimKV >= SnapKV at each ratio: each SlimKV against the SnapKV of the same ratio pooled the same way (same
    window, kernel, pooling), with its verdict and evidence; a SlimKV that has none against each SnapKV of its ratio,
    with the numbers, what differs, and no verdict."""
    described, lines = _described(rows), []
    snaps = [lab for lab, d in described.items() if family(d) == "SnapKV"]
    slims = [lab for lab, d in described.items() if family(d) == "SlimKV"]
    for slim in slims:
        same_ratio = [snap for snap in snaps if split_label(slim)[1] == split_label(snap)[1]]
        matched = [snap for snap in same_ratio if settings(described[slim]) == settings(described[snap])]
        # a SlimKV with a matched SnapKV is judged against it alone; one without shows why there is no verdict
        for snap in matched or same_ratio:
            a, b = settings(described[slim]), settings(described[snap])
            diff, se, n = paired_gap(scores(rows, slim), scores(rows, snap))
            diff, se = 100 * diff, None if se is None else 100 * se
            numbers = "in points, " + evidence(diff, se, paired=True, n=n, of="prompts", digits=1)
            head = f"SlimKV >= SnapKV, `{slim}` against `{snap}`"
            if a == b:
                lines.append(f"{head} (matched: {_settings_text(a)}; same prompts, same kept count): "
                             f"**{verdict(diff, se, n)}** ({numbers})")
            else:
                differs = "; ".join(f"{k} {a.get(k, '-').strip(chr(39))} against {b.get(k, '-').strip(chr(39))}"
                                    for k in SETTINGS if a.get(k) != b.get(k))
                lines.append(f"{head}: **no verdict**, not matched ({differs}; {numbers})")
    return lines


def versus_claims(rows: list[dict], pairs: list[tuple[str, str]]) -> list[str]:
    """"A >= B" for each (A, B) method pair at each ratio both ran, paired over the prompts both have, by the rule
    (`kvjax.experiments.verdicts`), with the KV bytes each held (a comparison at one nominal ratio is matched in bytes only
    where those agree: the line says what each held)."""
    lines = []
    by_label = {lab: [r for r in rows if r["label"] == lab] for lab in dict.fromkeys(r["label"] for r in rows)}
    for a, b in pairs:
        ratios = sorted({split_label(lab)[1] for lab in by_label if split_label(lab)[0] == a} &
                        {split_label(lab)[1] for lab in by_label if split_label(lab)[0] == b} - {None})
        if not ratios:
            lines.append(f"{a} >= {b}: **no verdict**, no ratio where both ran")
        for ratio in ratios:
            la, lb = f"{a}@{ratio:g}", f"{b}@{ratio:g}"
            sa, sb = scores(rows, la), scores(rows, lb)
            both = sa.keys() & sb.keys()
            if not both:  # each ran other prompts: nothing is paired
                lines.append(f"{a} >= {b} at {ratio:g}: **no verdict**, no prompt both ran")
                continue
            diff, se, n = paired_gap({k: sa[k] for k in both}, {k: sb[k] for k in both})
            diff, se = 100 * diff, None if se is None else 100 * se
            held = [[r.get("kv_held") for r in by_label[lab] if (r["task"], r["length"], r["index"]) in both]
                    for lab in (la, lb)]
            bytes_ = ("" if any(None in h for h in held) else
                      f"; KV held {sum(held[0]) / n:.3f} against {sum(held[1]) / n:.3f}")
            lines.append(f"{a} >= {b} at {ratio:g}: **{verdict(diff, se, n)}** (in points, "
                         + evidence(diff, se, paired=True, n=n, of="prompts", digits=1) + bytes_ + ")")
    return lines


def table(rows: list[dict]) -> str:
    """Prompts found per policy and task (of the task's prompts), the share over all tasks, the KV bytes held
    (`kv_held`, blank where the records predate it) and each policy's paired difference from the full cache. A
    policy whose run is not finished (fewer prompts than the full cache's) shows the prompts it has: a task it
    has none of is blank, its share and its difference are over its own prompts (the full cache's on the same)."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    full = scores(rows, "full") if "full" in labels else None
    per_task = {t: len({(r["length"], r["index"]) for r in rows if r["task"] == t}) for t in tasks}
    out = ["| policy | KV held | " + " | ".join(f"{t} (of {per_task[t]})" for t in tasks)
           + " | prompts | all its prompts, % | against the full cache, points (paired s.e.) |",
           "|---|---|" + "---|" * len(tasks) + "---|---|---|"]
    for lab in labels:
        mine = scores(rows, lab)
        held = [r.get("kv_held") for r in rows if r["label"] == lab]
        held_text = "" if None in held else f"{sum(held) / len(held):.3f}"
        found = [(sum(v for k, v in mine.items() if k[0] == t) if any(k[0] == t for k in mine) else None)
                 for t in tasks]
        share = 100 * sum(mine.values()) / len(mine)
        if full is None or lab == "full":
            gap = ""
        else:
            diff, se, _ = paired_gap(mine, {k: full[k] for k in mine})
            gap = f"{100 * diff:+.1f}" + ("" if se is None else f" ({100 * se:.1f})")
        out.append(f"| {lab} | {held_text} | " + " | ".join("" if f is None else f"{f:g}" for f in found)
                   + f" | {len(mine)} | {share:.0f} | {gap} |")
    return "\n".join(out)


def plot_held(rows: list[dict], path: Path) -> None:
    """Each method's share of prompts found (all tasks) against the KV bytes it held (mean `kv_held`), one line per
    method through its ratios, the full cache as a point at 1; a label whose records lack `kv_held` is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for method in dict.fromkeys(split_label(lab)[0] for lab in labels):
        pts = []
        for lab in labels:
            if split_label(lab)[0] != method:
                continue
            mine = [r for r in rows if r["label"] == lab]
            held = [r.get("kv_held") for r in mine]
            if None not in held:
                pts.append((sum(held) / len(held), 100 * sum(float(r["score"]) for r in mine) / len(mine)))
        if pts:
            ax.plot(*zip(*sorted(pts)), marker="o" if method != "full" else "*", markersize=4 if method != "full"
                    else 10, label=method)
    ax.set(xscale="log", xlabel="KV bytes held (share of the full cache)", ylabel="prompts found, all tasks (%)",
           ylim=(-2, 102))
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
