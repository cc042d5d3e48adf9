"""The tables of `benchmarks.tpu_aot`: `tpu_aot_{chip}.json` (its rows) and `tpu_aot_{chip}.md`, from the records."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvjax import tpu

MiB, GiB = 1 << 20, 1 << 30
# The commit of the rows recorded before each row named its own (all compiled at it): before the layers were scanned
# (e189fcc) and a scanned run picked its parameters instead of stacking them (`kvjax.models.llama.stacks_parameters`).
FIRST_RECORDS = "e20520c"


FIT_POINTS = {1: (8192, 32768), 8: (2048, 8192)}  # prompt lengths compiled to fit memory against length, by batch
MAX_PROMPT = 131072  # the Llama 3 models' context


def largest_prompt(rows: list[dict], chip: str) -> int | None:
    """The longest prompt (a multiple of 1024, at most 128K) whose prefill the affine fit of the compiled points'
    peak bytes against prompt length puts within `chip`'s HBM; None if even the shortest point does not fit."""
    pts = sorted((r["spec"][5], r["peak_bytes"]) for r in rows if r["ok"])
    if len(pts) < 2:
        return None
    (t0, m0), (t1, m1) = pts[0], pts[-1]
    slope = (m1 - m0) / (t1 - t0)
    room = tpu.CHIPS[chip].hbm_bytes - m0
    if room < 0:
        return None
    t = MAX_PROMPT if slope <= 0 else min(MAX_PROMPT, t0 + int(room / slope))
    return t // 1024 * 1024


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _latest(rows: list[dict], chip: str) -> list[dict]:
    """One row per program (the last recorded), in the order first recorded; a compile refused for the chip's HBM
    in either of libtpu's wordings ("Ran out of memory on HBM", "CompileTimeHbmOom") does not fit."""
    by_spec: dict[str, dict] = {}
    for r in rows:
        if r["chip"] == chip:
            if not r["ok"] and r.get("fits") is None and "RESOURCE_EXHAUSTED" in r["error"] and "hbm" in r[
                    "error"].lower():
                r = r | {"fits": False}
            by_spec[json.dumps(r["spec"])] = r
    return list(by_spec.values())


def _num(x, unit, digits=2):
    return "" if x is None else f"{x / unit:.{digits}f}"


# a row compiled before rows named their machine (`benchmarks.timing.machine`)
UNRECORDED = "?"


def hosts(records: list[dict]) -> dict[str, str]:
    """A label for each machine that compiled some of `records`, numbered in the order the records first name it
    (every chip's, so a machine has one label in both tables, and a recompiled row never renumbers the others)."""
    names = dict.fromkeys(r["host"] for r in records if r.get("host"))
    return {name: str(i + 1) for i, name in enumerate(names)}


def _host(r: dict, labels: dict[str, str]) -> str:
    return labels[r["host"]] if r.get("host") else UNRECORDED


def kernel_table(rows: list[dict], labels: dict[str, str]) -> list[str]:
    out = ["| kernel | shape | compiles | compile s | arguments MiB | temporaries MiB | peak MiB | load | host |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["spec"][0].startswith("model"):
            continue
        status = "yes" if r["ok"] else f"**no**: {r['error']}"
        out.append(f"| {r['kernel']} | {r['shape']} | {status} | {r.get('compile_s', '')} | "
                   f"{_num(r.get('argument_bytes'), MiB, 1)} | {_num(r.get('temp_bytes'), MiB, 1)} | "
                   f"{_num(r.get('peak_bytes'), MiB, 1)} | {r.get('load', '')} | {_host(r, labels)} |")
    return out


def model_table(rows: list[dict], chip: str, labels: dict[str, str]) -> list[str]:
    bw = tpu.CHIPS[chip].hbm_bandwidth
    out = ["| model | program | policy | batch | prompt | compile s | arguments GiB | temporaries GiB | peak GiB | "
           "fits | GFLOP | GB accessed | accessed / arguments | roofline ms (arguments at HBM bandwidth) | load | "
           "host | code |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        spec = r["spec"]
        if not spec[0].startswith("model"):
            continue
        model, policy, program, batch, prompt = spec[1:6]
        step = program == "step"
        if spec[0] == "model-tp":
            program += " (TP 4 chips)"
        fits = {True: "yes", False: "**no**", None: ""}[r.get("fits")]
        if not r["ok"]:
            out.append(f"| {model} | {program} | {policy} | {batch} | {prompt} | | | | | {fits} | | | | "
                       f"{r['error'][:160]} | {r.get('load', '')} | {_host(r, labels)} | "
                       f"{r.get('commit', FIRST_RECORDS)} |")
            continue
        ratio = f"{r['bytes_accessed'] / r['argument_bytes']:.2f}" if step else ""
        ms = f"{1e3 * r['argument_bytes'] / bw:.2f}" if step else ""
        out.append(f"| {model} | {program} | {policy} | {batch} | {prompt} | {r['compile_s']:.1f} | "
                   f"{_num(r['argument_bytes'], GiB)} | {_num(r['temp_bytes'], GiB)} | {_num(r['peak_bytes'], GiB)} | "
                   f"{fits} | {r['flops'] / 1e9:.1f} | {r['bytes_accessed'] / 1e9:.2f} | {ratio} | {ms} | "
                   f"{r.get('load', '')} | {_host(r, labels)} | {r.get('commit', FIRST_RECORDS)} |")
    return out


def _prefills(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["spec"][0] == "model" and r["spec"][3] == "prefill" and len(r["spec"]) == 6]


def largest_table(records: list[dict], chip: str) -> list[str]:
    """Per model, policy and batch: the longest prompt whose prefill the fit (on the larger chip's compiles, as
    `benchmarks.tpu_aot.models_stage` makes them) predicts within this chip's HBM, and whether this chip's
    compile at that length fits (the compiler's verdict)."""
    chips = {r["chip"] for r in _prefills(records)}
    fit_chip = max(chips, key=lambda c: tpu.CHIPS[c].hbm_bytes)
    fit_rows, own = _prefills(_latest(records, fit_chip)), _prefills(_latest(records, chip))
    out = ["| model | policy | " + " | ".join(f"batch {b}: largest prompt (compiled peak GiB)" for b in FIT_POINTS)
           + " |", "|---|---|" + "---|" * len(FIT_POINTS)]
    combos = sorted({(r["spec"][1], r["spec"][2]) for r in fit_rows})
    for model, policy in combos:
        cells = []
        for b in FIT_POINTS:
            pts = [r for r in fit_rows if r["spec"][1:3] == [model, policy] and r["spec"][4] == b
                   and r["spec"][5] in FIT_POINTS[b]]
            t = largest_prompt(pts, chip)
            check = next((r for r in own if r["spec"][1:3] == [model, policy] and r["spec"][4] == b
                          and r["spec"][5] == t), None)
            fitting = [r["spec"][5] for r in pts if r["ok"] and tpu.CHIPS[chip].fits(r["peak_bytes"])]
            if check is None and chip == fit_chip and t is not None:  # the fit chip: its own points, no check
                cells.append(f"{t} (predicted from this chip's compiles at {', '.join(map(str, FIT_POINTS[b]))})")
            elif t is None and fitting:  # the longer point does not fit: the largest lies between the two
                cells.append(f"between {max(fitting)} and {max(FIT_POINTS[b])} (not fitted)")
            elif t is None:
                cells.append("none (the fit points do not fit)")
            elif check is None:
                cells.append(f"{t} (not compiled)")
            elif check.get("fits"):
                cells.append(f"**{t}** ({check['peak_bytes'] / GiB:.2f})")
            elif check.get("fits") is False:
                cells.append(f"{t}: does **not** fit when compiled")
            else:  # refused for another reason than the chip's HBM (e.g. a kernel's scalar memory)
                cells.append(f"{t}: does **not** compile ({check.get('error', '')[:120]})")
        out.append(f"| {model} | {policy} | " + " | ".join(cells) + " |")
    return out


def write_tables(records: list[dict], chip: str, out_dir: Path) -> str:
    rows, labels = _latest(records, chip), hosts(records)
    legend = [f"{labels[name]}: {name}" for name in dict.fromkeys(r["host"] for r in rows if r.get("host"))]
    if any(not r.get("host") for r in rows):
        legend.append(f"{UNRECORDED}: not recorded (compiled before rows named their machine)")
    c = tpu.CHIPS[chip]
    md = [f"# kvjax compiled for TPU {chip} (`python -m benchmarks.tpu_aot`)", "",
          f"Compiled ahead of time by libtpu for a virtual `{c.topology}` topology, one chip, on a CPU-only machine: "
          f"nothing here ran on a TPU. Bytes are the compiler's memory analysis; 'fits' compares the program's peak "
          f"(arguments + outputs not aliased + temporaries) with the chip's {c.hbm_bytes / GiB:.0f} GiB of HBM. "
          f"Flops and bytes accessed are its cost analysis, which does not count what a Mosaic kernel reads itself "
          f"(XLA sees a custom call): under `attention_impl=\"pallas\"` a decode step's bytes are its weights, "
          f"the cache writes and the rest, not the attention kernel's reads of the cache. A decode step's roofline "
          f"is its arguments (the weights and the cache, read once each) at {c.hbm_bandwidth / 1e9:.0f} GB/s: the "
          f"least time it can take on this chip, not a measurement. "
          "Compile seconds are wall time on the CPU of the `host` column and compare only between rows of one "
          "host (the same programs compiled in 0.5–0.6 of the seconds on one machine as on another, "
          "`tpu_compile_same_machine.md`)" + (": " + "; ".join(legend) if legend else "") + ". `load` is the "
          "1-minute load average around each compile (above half the host's cores, another job shared them and the "
          "seconds are inflated).", ""]
    if any(not r["spec"][0].startswith("model") for r in rows):
        md += ["## Kernels (Mosaic)", "", *kernel_table(rows, labels), ""]
    if any(r["spec"][0].startswith("model") for r in rows):
        md += ["## Whole model (kvjax's Llama, bf16, `attention_impl=\"pallas\"`)", "",
               "Llama-3.2-1B and Llama-3.1-8B shapes with random weights. Budgets: 4096 slots per layer and KV head "
               "(SnapKV, AdaKV's mean, RazorAttention's local heads with 2 of 8 KV heads retrieval); "
               "`full-4bit` is FullCache in 4-bit KIVI codes (group 32, 128 residual tokens). `step` is one decode "
               "step (`kvjax.engine.decode`), `loop` the decode loop of 256 tokens (`kvjax.generate.decode_fn`), "
               "`question` a 64-token question read into the compressed cache (`kvjax.generate.question_fn`: one "
               "forward, `kvjax.step.Append`, where the plan only appends while decoding, as FullCache and SnapKV "
               "do; token by token otherwise), `prefill-xla` the prompt pass with `attention_impl=\"xla\"`. TP: tensor parallel over the 2x2 "
               "topology's 4 chips (`kvjax.sharding`'s placement, the Pallas kernels under `shard_map`); its bytes "
               "are per chip. `code`: the commit compiled (`+` where the tree had changes)." + (
                   " The rows of " + FIRST_RECORDS + " predate the scan over layers (e189fcc): they compiled the "
                   "unrolled model, not today's scanned one." if any("commit" not in r for r in rows) else "") +
               " XLA's cost analysis counts a loop's body once, so a scanned program's GFLOP and GB accessed count "
               "one layer of each scanned run.",
               "",
               *model_table(rows, chip, labels), "",
               "## The largest prompt each policy fits", "",
               "An affine fit of the prefill's compiled peak bytes against prompt length (two compiled lengths per "
               "batch, on the larger chip, v6e), solved for this chip's HBM and rounded down to 1024 tokens (at "
               "most 128K, the models' context); on the smaller chip (v5e) then compiled at that length, the "
               "compiler's check of the fit. The prefill bounds the "
               "run: it holds the weights, the whole cache it returns and the prompt's activations, and the decode "
               "loop then holds only the weights and the cache.", "", *largest_table(records, chip), ""]
    text = "\n".join(md)
    _atomic(out_dir / f"tpu_aot_{chip}.md", text)
    _atomic(out_dir / f"tpu_aot_{chip}.json", json.dumps(rows, indent=1))
    return text
