"""Issue 89's fifth sweep (items 7, 8, 11, 12, 13, 15-19): what was silently wrong or accepted without a word, the
tracebacks on user errors and the messages that named a Python keyword instead of the flag the user typed. Each
user error is one line, exit 2 (`kvjax.cli.run`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvjax.errors import InvalidInput, MissingFile, NonFiniteError
from kvjax.experiments import cli
from kvjax.generate import generate
from kvjax.policies import AdaKV, CriticalAdaKV, KVgrad, KVzip, Quantized, SnapKV, StreamingLLM

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))


def one_line(run: subprocess.CompletedProcess) -> str:
    """The last line of a command that ended as a user error: exit 2, `error:` or argparse's `usage` line first."""
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    return run.stderr.strip().splitlines()[-1]


def command(*argv: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=cwd, env=ENV, capture_output=True, text=True)


# ---- item 7: AdaKV's layer-wide top-k on prompts no longer than the observation window ---------------------------


@pytest.mark.parametrize("cls", [AdaKV, CriticalAdaKV])
def test_reliability_adakv_family_keeps_its_count_on_prompts_inside_the_window(tiny, cls):
    """A prompt no longer than the scorer's 32-token window has no scored key, and its tokens tied with the padding
    at -inf: the layer's top-k took padding slots and kept no prompt token ([[0, 0], [0, 0]] for 8 tokens, 20 of 28
    in one head). Each layer now keeps its KV heads' count, kv_heads x floor(n / 2) at ratio 0.5, prompt tokens only,
    for each row of a padded batch (hand-computed: 8 of 8, 14 of 28, 4 of 4 per layer of 2 KV heads)."""
    rng = np.random.RandomState(0)
    rows = [rng.randint(5, tiny.config.vocab_size, n).tolist() for n in (8, 28, 4)]
    out = generate(tiny.model, rows, cls(scorer=SnapKV(ratio=0.5)), max_new_tokens=1)
    kvh = tiny.config.num_kv_heads
    for layer in out.cache:
        for r, ids in enumerate(rows):
            pos = np.asarray(layer.pos[r])
            kept = (pos >= 0) & (pos < len(ids))
            assert kept.sum() == kvh * (len(ids) // 2), (r, pos)
            assert set(np.asarray(layer.head[r])[kept]) <= set(range(kvh))


# ---- item 8 and item 19's policy repr: a quantized cache that would hold other slots, or none ---------------------


@pytest.mark.parametrize("inner", [KVzip(ratio=0.5, repeat_ids=(5,), continue_ids=(6,), suffix_ids=(7,)),
                                   KVgrad(ratio=0.5, repeat_ids=(5,), continue_ids=(6,), suffix_ids=(7,))],
                         ids=["kvzip", "kvgrad"])
def test_cli_error_a_quantized_kvzip_family_cache_is_refused(inner):
    """Under `Quantized` generation never replayed the prompt (the replay looked for a KVzip policy), so the 4-bit
    "KVzip" kept every slot, silently. It is refused by name until a quantized cache keeps KVzip's slots."""
    with pytest.raises(InvalidInput, match=rf"{type(inner).__name__}: its slots are scored by replaying the prompt"):
        Quantized(inner, bits=4, group=8, residual=8)


def test_cli_error_quantized_refusals_name_the_policy_and_the_flag():
    """`--kv-bits` on a policy that cannot be quantized printed the policy's whole repr (`error: CriticalAdaKV(scorer=
    SnapKV(budget=None, ratio=0.5, ...`); it names the policy and the flag now."""
    for policy, why in (("kvzip", "its slots are scored by replaying"), ("critical-adakv", "share one pool of slots"),
                        ("adakv", "share one pool of slots")):
        line = one_line(command("kvjax.experiments.generate", "--policy", policy, "--ratio", "0.5", "--kv-bits", "4",
                                "the quick brown fox"))
        assert line.startswith(f"error: --policy {policy} with --kv-bits 4: ") and why in line, line
        assert "scorer=SnapKV(" not in line


# ---- item 11: kvpress_agreement against another model, another length, no samples --------------------------------


def test_identity_kvpress_agreement_refuses_a_run_of_another_model(tiny):
    """Given a model other than the run's, kvpress_agreement tabulated kvpress on one model against kvjax's records of
    another. The run's weights digest (or, for runs recorded before the digest of arrays, its file's fingerprint) and
    dtype must be the model's."""
    from kvjax.experiments.identity import model_identity
    from kvjax.experiments.kvpress_agreement import check_same_model
    from kvjax.experiments.records import model_fingerprint

    ours = {"model class": "kvjax.models.llama.Llama", "weights": model_identity(tiny.model)["weights"],
            "model dtype": str(tiny.model.dtype)}
    check_same_model(Path("run"), ours, tiny)
    check_same_model(Path("run"), {"weights": model_fingerprint(tiny.path), "model dtype": ours["model dtype"]}, tiny)
    with pytest.raises(InvalidInput, match=r"its weights \([0-9a-f]{16}, float32\) are not those of the run in run "
                                           r"\(0123456789abcdef, float32\)"):
        check_same_model(Path("run"), {**ours, "weights": "0123456789abcdef"}, tiny)


def test_cli_error_kvpress_agreement_needs_a_sample():
    line = one_line(command("kvjax.experiments.kvpress_agreement", "--records", "r", "--model", "m", "--samples", "0",
                            "--out", "o"))
    assert "argument --samples: 0 must be >= 1" in line


# ---- items 12 and 17: report_page from non-finite, repeated, torn or missing records ------------------------------


@pytest.fixture
def page(tmp_path):
    """A page with one RULER block over a copy of the report's committed chat-template run."""
    run = tmp_path / "report-smollm2" / "runs" / "ruler"
    shutil.copytree(REPO / "docs" / "report-smollm2" / "runs" / "ruler", run)
    text = (REPO / "docs" / "report-smollm2.md").read_text()
    start = text.index("<!-- records: ruler report-smollm2/runs/ruler -->")
    block = text[start:text.index("<!-- /records -->", start) + len("<!-- /records -->")]
    page = tmp_path / "page.md"
    page.write_text("# page\n\n" + block + "\n")
    return page, run


def report_page(page, *extra):
    return command("kvjax.experiments.report_page", str(page), *extra)


def test_nonfinite_report_page_refuses_a_nan_record_and_a_repeated_one(page):
    """`report_page` regenerated a page from a NaN record (the page showed `nan`) and from a record written twice,
    without a word. Both are one line naming the file and the line."""
    page, run = page
    assert report_page(page, "--check").returncode == 0
    preds = run / "preds.jsonl"
    lines = preds.read_text().splitlines()
    record = json.loads(lines[3])
    preds.write_text("\n".join(lines + [lines[3]]) + "\n")
    line = one_line(report_page(page, "--check"))
    assert line == f"error: {preds}:{len(lines) + 1} repeats the record {record['id']!r} of line 4: each record once"
    preds.write_text("\n".join(lines[:3] + [lines[3].replace(f'"score": {record["score"]}', '"score": NaN')]
                               + lines[4:]) + "\n")
    line = one_line(report_page(page))
    assert line.startswith(f"error: {preds}:4 holds a non-finite number") and "no table is made from it" in line


def test_cli_error_report_page_check_on_torn_records_and_a_missing_identity(page):
    page, run = page
    preds = run / "preds.jsonl"
    text = preds.read_text()
    preds.write_text(text[: len(text) // 2])  # torn mid-record
    line = one_line(report_page(page, "--check"))
    assert line.startswith(f"error: {preds}:") and line.endswith("is not valid JSON; the record was torn or edited")
    preds.write_text(text)
    (run / "identity.json").unlink()
    assert one_line(report_page(page, "--check")) == f"error: {run / 'identity.json'}: no records there"


# ---- item 13: options that would be ignored, benchmarks that would measure nothing --------------------------------


def test_cli_error_report_kvzap_without_the_kvzap_method(tmp_path):
    """`report --kvzap DIR` without kvzap among --ruler-methods was silently ignored (refused now before the model
    loads: the model named here does not exist, which would be the error otherwise)."""
    line = one_line(command("kvjax.experiments.report", "--kvzap", "kvjax/models/kvzap/kvjax-small/linear",
                            "--ruler-methods", "snapkv", "--model", str(tmp_path / "none"), "--out",
                            str(tmp_path / "out")))
    assert line.endswith("--kvzap kvjax/models/kvzap/kvjax-small/linear is section 4's KVzap surrogate, but "
                         "--ruler-methods does not name kvzap")


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "0"], "argument --lengths: 0 must be >= 1"),
    (["--lengths", "abc"], "argument --lengths: 'abc' is not an integer"),
    (["--repeats", "0"], "argument --repeats: 0 must be >= 1"),
    (["--batches", "0"], "argument --batches: 0 must be >= 1"),
    (["--new", "0"], "argument --new: 0 must be >= 1"),
    (["--lengths", "4096", "--batches", "8", "--max-batch-tokens", "100"],
     "--max-batch-tokens 100 is below every --lengths x --batches cell: nothing would be measured"),
])
def test_cli_error_e2e_arguments(argv, message):
    """benchmarks.e2e: `--lengths 0` exited 0 with nothing measured; abc, 0 repeats / batches / new tokens were
    tracebacks (a spread of no measurement, matplotlib's log scale, JAX)."""
    assert message in one_line(command("benchmarks.e2e", "--no-torch", "--out", "unused", *argv))


def test_cli_error_an_out_that_is_a_file_and_a_chip_that_is_none(tmp_path):
    """benchmarks.e2e and tpu_aot with --out a file were `FileExistsError`s; tpu_aot with no chips exited 0 (or a
    `ValueError`); `kvjax.tpu`'s helpers raised `KeyError` for an unknown chip."""
    from kvjax import tpu

    afile = tmp_path / "afile"
    afile.write_text("")
    for module in ("benchmarks.e2e", "benchmarks.tpu_aot"):
        assert one_line(command(module, "--out", str(afile))).endswith(
            f"argument --out: {afile} is a file, not a folder; pass a folder for the results")
    assert one_line(command("benchmarks.tpu_aot", "--chips", "", "--out", str(tmp_path / "t"))) == \
        "error: --chips '' names no chip; give one or more of v5e, v6e"
    for helper in (tpu.offline_env, tpu.topology, tpu.chip):
        with pytest.raises(InvalidInput, match="TPU chip 'v9x' is not one of v5e, v6e"):
            helper("v9x")


# ---- item 15: a KVzap surrogate directory with part of its parameters ---------------------------------------------


def test_cli_error_a_partial_kvzap_surrogate(tmp_path):
    """A surrogate directory missing a data file of its orbax checkpoint ended in orbax's `NOT_FOUND ... zarr` (from a
    background thread). Its files are recorded at save (`kvzap.json`'s `files`) and checked first, by name."""
    from kvjax.surrogate import load

    copy = tmp_path / "kvzap"
    shutil.copytree(REPO / "kvjax" / "models" / "kvzap" / "kvjax-small" / "linear", copy)
    gone = sorted((copy / "params" / "d").iterdir())[0]
    gone.unlink()
    with pytest.raises(InvalidInput, match=rf"{gone}: missing; the surrogate directory is a partial or damaged copy"):
        load(copy)
    line = one_line(command("kvjax.experiments.generate", "--policy", "kvzap", "--kvzap", str(copy), "--threshold",
                            "0", "hello"))
    assert f"{gone}: missing" in line


# ---- item 16: a chat template that does not parse, or drops the message -------------------------------------------


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{{ m['content'] }", "the tokenizer's chat template cannot be applied (TemplateSyntaxError"),
    ("{% for m in messages %}U:\n{% endfor %}A:", "the tokenizer's chat template renders a user turn without its "
                                                  "content"),
], ids=["unparsable", "drops-content"])
def test_cli_error_a_chat_template_that_cannot_place_the_context(tmp_path, template, message):
    """`--chat-template` with a template that does not parse was jinja2's `TemplateSyntaxError`; one that renders
    without the message's content, `ValueError: not enough values to unpack`. Both are one line, before the run."""
    d = tmp_path / "model"
    shutil.copytree(REPO / "kvjax" / "models" / "default", d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    out = tmp_path / "r"
    line = one_line(command("kvjax.experiments.ruler", "--model", str(d), "--tasks", "niah_single_1", "--samples", "1",
                            "--chat-template", "on", "--compare", "full", "--out", str(out)))
    assert message in line and "pass --chat-template off" in line, line
    assert not out.exists()


# ---- item 19: messages name the flags the user typed --------------------------------------------------------------


def test_cli_error_messages_name_the_flags_of_the_command(tmp_path):
    """train_kvzap's refusals named `--seq-len` (its flag is `--length`) and `out=` (its flag is `--out`); the
    report's RULER refusals named the suite's keyword `tasks=` (the report's flag is `--ruler-tasks`)."""
    data = tmp_path / "short.txt"
    data.write_text("a few words only. " * 3)
    line = one_line(command("kvjax.experiments.train_kvzap", "--data", str(data), "--length", "256", "--out",
                            str(tmp_path / "kz")))
    assert "--length" in line and "--seq-len" not in line, line
    afile = tmp_path / "afile"
    afile.write_text("")
    line = one_line(command("kvjax.experiments.train_kvzap", "--texts", "1", "--heldout-texts", "1", "--length", "64",
                            "--out", str(afile)))
    assert line == f"error: --out {afile} is a file, not a directory; pass a directory for the results", line
    from kvjax.experiments.driver import ArgumentError, call

    def ruler_like(**kw):
        raise ArgumentError("tasks=['x'] is unknown; pass tasks= without it")

    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--ruler-tasks")
    with pytest.raises(SystemExit):
        call(p, ruler_like, flag_names={"tasks": "ruler_tasks"})


def test_cli_error_report_ruler_refusal_names_the_reports_flag(capsys):
    from kvjax.experiments.report import RULER_FLAGS
    from kvjax.experiments.driver import as_flags

    got = as_flags("tasks=['niah_single_1'] does not fit; pass tasks= without niah_single_1, a longer lengths=",
                   {"ruler_tasks", "ruler_length", "samples"}, RULER_FLAGS)
    assert got == ("--ruler-tasks ['niah_single_1'] does not fit; pass --ruler-tasks without niah_single_1, a longer "
                   "--ruler-length")
