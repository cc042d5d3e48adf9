"""No silently wrong results (issue #21): the whole configuration in the resume identity, non-finite
guards, options validated where parsed, true advice, one-line CLI errors, crash-safe records, loading.

Test names carry the item they cover: `identity`, `nonfinite`, `cli_error`, `atomic`, `loading`,
`progress` (`pytest -k "identity or nonfinite or cli_error or atomic"`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kvjax.experiments import cli, passkey
from kvjax.experiments import generate as gen_cli
from kvjax.experiments.records import ResultLog, claim_results_dir, options_of
from kvjax import FullCache, Sampling, StreamingLLM, generate
from kvjax.errors import InvalidInput, NonFiniteError, PromptTooLong, UserError
from kvjax.policies import SnapKV
from kvjax.scoring import stream_logprobs
from kvjax.models import load
from kvjax import drive

REPO = Path(__file__).resolve().parents[1]


def run_cli(main, argv, capsys) -> tuple[int, str]:
    """(exit status, stderr) of `python -m kvjax.experiments.<name> argv`, run in this process."""
    code = cli.run(main, argv)
    return code, capsys.readouterr().err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("\r", "usage:", " "))]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def broken_dir(tmp_path_factory, tiny_dir):
    """`tiny_dir` with token 200's embedding set to NaN (and nothing else changed)."""
    d = tmp_path_factory.mktemp("nan_embed")
    for f in tiny_dir.iterdir():
        if f.is_file():
            (d / f.name).write_bytes(f.read_bytes())
    t = load_file(d / "model.safetensors")
    t["model.embed_tokens.weight"][200] = np.nan
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


# ---- 1. the resume identity is the whole configuration ----


def passkey_argv(tiny_dir, out, *extra):
    return ["--model", str(tiny_dir), "--lengths", "300", "--depths", "0.5", "--samples", "1", "--out", str(out),
            *extra]


def test_identity_passkey_seed_is_refused_naming_both_values(tiny_dir, tmp_path, capsys):
    # Seen before: --seed 1 over a seed-0 --out silently reused the seed-0 samples.
    out = tmp_path / "pk"
    assert cli.run(passkey.main, passkey_argv(tiny_dir, out)) == 0
    first = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    capsys.readouterr()
    code, err = run_cli(passkey.main, passkey_argv(tiny_dir, out, "--seed", "1"), capsys)
    assert code == 2
    assert "--seed: 0 -> 1" in one_error_line(err)
    # The records were not touched.
    assert [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()] == first


def test_identity_longbench_max_length_is_refused(tiny_dir, tmp_path, capsys):
    # Seen before: --max-length 64 over a default run's --out printed the default run's scores.
    from kvjax.experiments import longbench  # noqa: F401  (the package)
    from kvjax.experiments.longbench import __main__ as lb

    out = tmp_path / "lb"
    base = ["--model", str(tiny_dir), "--datasets", "stdlib_passkey", "--samples", "1", "--policy", "full",
            "--out", str(out)]
    assert cli.run(lb.main, base) == 0
    capsys.readouterr()
    code, err = run_cli(lb.main, base + ["--max-length", "64"], capsys)
    assert code == 2 and "--max-length: None -> 64" in one_error_line(err)


def test_identity_grows_with_the_compare_list_and_resumes(tiny_dir, tmp_path, capsys):
    # Records are keyed by each policy's full description, so adding a policy resumes the others.
    out = tmp_path / "pk"
    assert cli.run(passkey.main, passkey_argv(tiny_dir, out)) == 0
    done = (out / "samples.jsonl").read_text()
    assert cli.run(passkey.main, passkey_argv(tiny_dir, out, "--policy", "streaming", "--budget", "32")) == 0
    lines = (out / "samples.jsonl").read_text().splitlines()
    assert (out / "samples.jsonl").read_text().startswith(done) and len(lines) == 2
    assert {json.loads(line)["policy"] for line in lines} == {
        FullCache().describe(), StreamingLLM(budget=32, sinks=4).describe()}


SUITES = {
    # module: (argv beyond --model/--out, options that must be in the identity)
    "passkey": (["--lengths", "300"], {"--seed", "--batch", "--allow-nonfinite", "--gate-params"}),
    "longbench": (["--compare", "full"], {"--max-length", "--chat", "--dtype", "--attention-impl", "--e", "--batch",
                       "--data-dir", "--data-dir content"}),
    "needle": ([], {"--needle", "--question", "--answer", "--haystack", "--batch"}),
    "perplexity": ([], {"--text", "python"}),
    "zeroshot": ([], {"--data", "--items", "--seed", "--scoring"}),
    "efficiency": ([], {"--new", "--batch", "--repeats", "--dtype", "--attention-impl"}),
    "eval_anllm": (["--anchor-tokens", "."], {"--items", "--shots", "--options", "--seed", "--anchor-tokens", "--data"}),
}


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_identity_records_every_option_of_each_suite(suite, tiny_dir, tmp_path, monkeypatch):
    import importlib

    mod = importlib.import_module(f"kvjax.experiments.{suite}" if suite != "longbench" else "kvjax.experiments.longbench.__main__")
    seen = {}

    class Claimed(Exception):
        pass

    def claim(out, lm, options):
        seen.update(claim_results_dir(out, lm, options))
        raise Claimed

    from kvjax.experiments import driver

    for where in (mod, driver):  # a suite claims through the driver (or, not yet ported, itself)
        if hasattr(where, "claim_results_dir"):
            monkeypatch.setattr(where, "claim_results_dir", claim)
    extra, wanted = SUITES[suite]
    with pytest.raises(Claimed):
        mod.main(["--model", str(tiny_dir), "--out", str(tmp_path / suite), *extra])
    assert wanted <= set(seen), sorted(wanted - set(seen))
    import kvjax

    assert seen["kvjax"] == kvjax.__version__ and seen["weights"] and seen["model dtype"] == "float32"
    assert "--out" not in seen and "--debug" not in seen
    if suite not in ("eval_anllm",):  # policies live in the records' keys, with every parameter
        assert "--budget" not in seen and "--policy" not in seen


def test_identity_changed_data_content_is_refused(tiny_dir, tmp_path):
    lm = load(tiny_dir)
    data = tmp_path / "items.jsonl"
    data.write_text("one\n")
    import argparse

    args = argparse.Namespace(data=str(data), out="x", debug=False)
    claim_results_dir(tmp_path / "out", lm, options_of(args, files=("data",)))
    (tmp_path / "out" / "runs.jsonl").write_text('{"id": 1}\n')  # a record of that configuration
    data.write_text("two\n")  # same path, edited content
    with pytest.raises(InvalidInput, match=r"--data content: \['[0-9a-f]+'\] -> \['[0-9a-f]+'\]"):
        claim_results_dir(tmp_path / "out", lm, options_of(args, files=("data",)))


def test_identity_torn_file_is_a_cli_error(tiny_dir, tmp_path, capsys):
    out = tmp_path / "pk"
    out.mkdir()
    (out / "identity.json").write_text('{"kvjax": "0.1')  # torn by a crash
    code, err = run_cli(passkey.main, passkey_argv(tiny_dir, out), capsys)
    line = one_error_line(err)
    assert code == 2 and line.startswith("error: ") and str(out / "identity.json") in line


# ---- 2. non-finite numbers are errors ----


def test_nonfinite_weight_is_refused_at_load_naming_the_tensor(broken_dir):
    with pytest.raises(NonFiniteError, match=r"'model.embed_tokens.weight' .* holds 64 non-finite values .* Pass "
                                             r"allow_nonfinite=True"):
        load(broken_dir)
    lm = load(broken_dir, allow_nonfinite=True)
    assert np.isnan(np.asarray(lm.model.embed_tokens.embedding[...])[200]).all()


def test_nonfinite_weight_cli_error_and_allow_flag(broken_dir, tmp_path, capsys):
    code, err = run_cli(passkey.main, passkey_argv(broken_dir, tmp_path / "a"), capsys)
    line = one_error_line(err)
    assert code == 2 and "Pass --allow-nonfinite to load it anyway" in line and "model.embed_tokens.weight" in line
    assert "allow_nonfinite=True" not in line  # advice in the caller's terms
    # Allowed at load, the broken logits are still an error rather than a 0 % score.
    code, err = run_cli(passkey.main, passkey_argv(broken_dir, tmp_path / "b", "--allow-nonfinite"), capsys)
    assert code == 0 or "non-finite logits" in one_error_line(err)


def test_nonfinite_logits_in_generation_name_the_step_and_the_row(broken_dir, tmp_path):
    model = load(broken_dir, allow_nonfinite=True).model
    clean = list(range(10, 26))  # 16 tokens: one bucket, no padding
    poisoned = clean[:8] + [200] + clean[9:]
    with pytest.raises(NonFiniteError, match=r"at generated token 0 of row 1;"):
        generate(model, [clean, poisoned], FullCache(), max_new_tokens=4)
    # Clean prompts whose greedy continuation is a broken token: all-zero logits pick token 0,
    # whose embedding is NaN, so the logits of generated token 1 are NaN in both rows.
    d = copy_of(broken_dir, tmp_path / "zero_head")
    t = load_file(d / "model.safetensors")
    t["model.embed_tokens.weight"][0] = np.nan
    t["lm_head.weight"][:] = 0.0
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    model = load(d, allow_nonfinite=True).model
    with pytest.raises(NonFiniteError, match=r"at generated token 1 of row 0 \(2 rows affected\)"):
        generate(model, [clean, clean[::-1]], FullCache(), max_new_tokens=4)


def test_nonfinite_logprobs_in_scoring_name_the_token(broken_dir):
    model = load(broken_dir, allow_nonfinite=True).model
    ids = list(range(10, 40))
    ids[10] = 200  # from position 10 on, every logit sees a NaN key
    with pytest.raises(NonFiniteError, match=r"row 0, token 11 "):
        stream_logprobs(model, ids, StreamingLLM(budget=16, sinks=2))


def test_nonfinite_record_is_refused_and_not_stored(tmp_path):
    log = ResultLog(tmp_path / "r.jsonl")
    log.add({"id": "a", "ppl": 1.5})
    with pytest.raises(NonFiniteError, match=r"record 'b' has a non-finite value in \['ppl'\]"):
        log.add({"id": "b", "ppl": float("nan")})
    assert "b" not in log and len(ResultLog(tmp_path / "r.jsonl")) == 1
    # A NaN written by an older kvjax is refused when read back, naming the line.
    (tmp_path / "old.jsonl").write_text('{"id": "a", "ppl": NaN}\n')
    with pytest.raises(NonFiniteError, match=r"old.jsonl:1 holds a non-finite number"):
        ResultLog(tmp_path / "old.jsonl")


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_nonfinite_temperature_and_top_p_are_rejected(value, tiny_dir, capsys):
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=float(value))
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=float(value))
    # Seen before: --temperature nan printed eight <unk> and exited 0.
    with pytest.raises(SystemExit) as e:
        gen_cli.main(["--model", str(tiny_dir), "--temperature", value])
    assert e.value.code == 2 and f"argument --temperature: {value} must be a finite number >= 0" in \
        capsys.readouterr().err


# ---- 3. options validated where they are parsed ----


@pytest.mark.parametrize("flag,value,message", [
    ("--kernel", "4", "argument --kernel: 4 must be a positive odd number"),
    ("--kernel", "-3", "argument --kernel: -3 must be a positive odd number"),
    ("--budget", "0", "argument --budget: 0 must be >= 1"),
    ("--ratio", "1.5", "argument --ratio: 1.5 must be in [0, 1)"),
    ("--top-p", "0", "argument --top-p: 0 must be in (0, 1]"),
    ("--max-new-tokens", "0", "argument --max-new-tokens: 0 must be >= 1"),
])
def test_cli_error_bad_option_values_are_refused_at_parse(flag, value, message, tiny_dir, capsys):
    with pytest.raises(SystemExit) as e:
        gen_cli.main(["--model", str(tiny_dir), "--policy", "snapkv", flag, value])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cli_error_even_kernel_refused_by_the_api_too():
    with pytest.raises(ValueError, match="kernel=4 must be a positive odd number"):
        SnapKV(budget=64, kernel=4)
    with pytest.raises(ValueError, match=r"budget=0 must be >= 1 \(tokens kept per KV head\)"):
        SnapKV(budget=0, observation_window=0)
    with pytest.raises(ValueError, match="budget=8 must be at least observation_window=32"):
        SnapKV(budget=8)


@pytest.mark.parametrize("argv,message", [
    (["--policy", "full", "--budget", "64"], "--budget 64 does not apply to --policy full: full keeps every token"),
    (["--policy", "razor", "--budget", "64"], "razor sizes its local heads with --compression and --buffer"),
    (["--policy", "snapkv", "--budget", "64", "--ratio", "0.5"], "--budget 64 and --ratio 0.5 both size the cache"),
    (["--policy", "streaming", "--kernel", "5"], "--kernel: no policy of streaming takes it"),
])
def test_cli_error_budget_or_option_a_policy_ignores(argv, message, tiny_dir, capsys):
    code, err = run_cli(gen_cli.main, ["--model", str(tiny_dir), *argv], capsys)
    assert code == 2 and message in one_error_line(err)


def test_loading_config_with_fewer_layers_than_the_checkpoint_is_refused(tiny_dir, tmp_path):
    d = tmp_path / "short"
    d.mkdir()
    for f in tiny_dir.iterdir():
        if f.is_file():
            (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    # refused before the model is built (the layer count of the checkpoint against the config's)
    with pytest.raises(InvalidInput, match=r"the checkpoint in .*short has 2 layers, its config 1"):
        load(d)


# ---- 4. advice in errors is true for the caller ----


def test_cli_error_prompt_too_long_advice_names_the_flag_and_never_what_is_set(tiny_dir, capsys):
    lm = load(tiny_dir)
    n = lm.config.max_position_embeddings
    with pytest.raises(PromptTooLong) as e:
        generate(lm.model, [[5] * (n + 10)], FullCache(), max_new_tokens=4)
    assert "pass truncate=True" in str(e.value) and "--truncate" not in str(e.value)
    assert "rolling" not in str(e.value)  # the prompt alone is too long: rolling positions would not help
    assert "pass --truncate" in e.value.cli_message()
    # Fits alone, not with the new tokens: rolling positions are true advice.
    with pytest.raises(PromptTooLong, match=r'use positions="rolling"'):
        generate(lm.model, [[5] * (n - 2)], FullCache(), max_new_tokens=4)
    # Truncation already on but no room left: never advise truncation again.
    with pytest.raises(PromptTooLong) as e:
        generate(lm.model, [[5] * (n + 10)], FullCache(), max_new_tokens=n - 1, truncate=True)
    assert "truncate" not in str(e.value).split(";")[1] and "generate fewer tokens" in str(e.value)
    code, err = run_cli(gen_cli.main, ["--model", str(tiny_dir), "--max-new-tokens", "8", "x" * (n + 10)], capsys)
    assert code == 2 and "pass --truncate (LongBench's middle truncation)" in one_error_line(err)


# ---- 5. user errors end as one line; internal errors keep their traceback ----


def copy_of(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("damage,named", [
    ("missing", "does not exist"),
    ("config", "config.json is not valid JSON"),
    ("tokenizer", "tokenizer.json"),
    ("safetensors", "model.safetensors"),
    ("no_weights", "no weights in"),
])
def test_cli_error_broken_model_directory_is_one_line(damage, named, tiny_dir, tmp_path, capsys):
    d = tmp_path / "m"
    if damage != "missing":
        copy_of(tiny_dir, d)
    if damage == "config":
        (d / "config.json").write_text('{"model_type": "llama", ')
    elif damage == "tokenizer":
        (d / "tokenizer.json").write_text("{not json")
    elif damage == "safetensors":
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "no_weights":
        (d / "model.safetensors").unlink()
    code, err = run_cli(passkey.main, passkey_argv(d, tmp_path / "out"), capsys)
    line = one_error_line(err)
    assert code == 2 and line.startswith("error: ") and named in line, line


def test_cli_error_real_process_exit_code_and_debug_traceback(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    args = [sys.executable, "-m", "kvjax.experiments.perplexity", "--model", str(tmp_path / "nope")]
    r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: model directory {str(tmp_path / 'nope')!r} does not exist"]
    r = subprocess.run(args + ["--debug"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" in r.stderr and "MissingFile" in r.stderr


def test_cli_error_internal_errors_keep_their_traceback():
    def buggy(argv):
        raise IndexError("a bug")

    with pytest.raises(IndexError):
        cli.run(buggy, [])
    assert issubclass(NonFiniteError, UserError)


# ---- 6. records are crash-safe ----


def test_atomic_rewrite_killed_midway_loses_no_finished_record(tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps({"id": i, "v": i}) + "\n" for i in range(3)) + '{"id": 3, "v"')
    before = path.read_text()

    def killed(src, dst):  # the process dies after writing the temporary file, before the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        ResultLog(path)  # drops the torn line with an atomic rewrite
    assert path.read_text() == before and not list(tmp_path.glob(".log.jsonl.*"))
    monkeypatch.undo()
    log = ResultLog(path)
    assert sorted(log.records) == ["0", "1", "2"]
    assert path.read_text().endswith('"v": 2}\n')


def test_atomic_write_leaves_the_permissions_of_a_plain_write(tmp_path):
    """A result written atomically is as readable as one written with open(): the temporary file's
    0600 is not what the user gets."""
    import stat

    from kvjax.experiments.records import write_atomic

    (tmp_path / "plain.md").write_text("x")
    write_atomic(tmp_path / "atomic.md", "x")
    mode = lambda name: stat.S_IMODE((tmp_path / name).stat().st_mode)  # noqa: E731
    assert mode("atomic.md") == mode("plain.md")


def test_atomic_identity_write_is_all_or_nothing(tiny_dir, tmp_path, monkeypatch):
    lm = load(tiny_dir)

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        claim_results_dir(tmp_path / "out", lm, {"--seed": 0})
    assert not (tmp_path / "out" / "identity.json").exists()
    monkeypatch.undo()
    claim_results_dir(tmp_path / "out", lm, {"--seed": 0})
    assert json.loads((tmp_path / "out" / "identity.json").read_text())["--seed"] == 0


def test_atomic_sigkill_while_appending_loses_no_acknowledged_record(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from kvjax.experiments.records import ResultLog
        log = ResultLog({str(tmp_path / 'log.jsonl')!r})
        i = len(log)
        while True:
            log.add({{"id": i, "payload": "x" * 2000}})
            print(i, flush=True)
            i += 1
    """)
    acknowledged = []
    for _ in range(3):  # killed three times at arbitrary moments, resumed each time
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        for _ in range(50):
            acknowledged.append(int(proc.stdout.readline()))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    log = ResultLog(tmp_path / "log.jsonl")
    assert set(acknowledged) <= {int(k) for k in log.records}


# ---- 7. loading ----


def test_loading_legacy_pytorch_bin_without_mmap(tmp_path):
    torch = pytest.importorskip("torch")
    from tests.conftest import hf_llama

    pt, d = hf_llama(tmp_path / "hf")
    legacy = copy_of(d, tmp_path / "legacy")
    (legacy / "model.safetensors").unlink()
    torch.save(pt.state_dict(), legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    import zipfile

    assert not zipfile.is_zipfile(legacy / "pytorch_model.bin")
    ids = np.arange(5, 25)[None]
    want = np.asarray(drive.logits(load(d).model, ids, np.arange(20)[None]))
    np.testing.assert_array_equal(np.asarray(drive.logits(load(legacy).model, ids, np.arange(20)[None])), want)


def test_loading_remote_code_hint_is_reported_once(tiny_dir, tmp_path, caplog):
    d = copy_of(tiny_dir, tmp_path / "remote")
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (d / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger="kvjax.models.loading"):
        load(d, tokenizer=False)
        load(d, tokenizer=False)
    notes = [r for r in caplog.records if "ships its own code" in r.getMessage()]
    assert len(notes) == 1 and "kvjax never runs it" in notes[0].getMessage()


# ---- 8. long CLI runs show progress, and generate once ----


def test_progress_generate_cli_shows_a_bar_and_generates_once(tiny_dir, capsys, monkeypatch):
    calls = []
    real = gen_cli.generate_many
    monkeypatch.setattr(gen_cli, "generate_many", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert gen_cli.main(["--model", str(tiny_dir), "--policy", "full", "--max-new-tokens", "24", "hi"]) == 0
    out, err = capsys.readouterr()
    assert calls == [1]
    assert "decode" in err and "tok" in err  # the tqdm bar
    assert "compilation excluded" in out


def test_progress_hook_sees_every_step(tiny):
    steps = []
    out = generate(tiny.model, [[5, 6, 7]], FullCache(), max_new_tokens=9, progress=steps.append)
    assert steps == list(range(1, 1 + out.decode_steps))


# ---- round 3 (issue #50): the library API ----


def test_cli_error_api_refuses_texts_past_the_window_at_absolute_positions(tmp_path):
    """`scoring.perplexity` and the zero-shot scorer once scored a text longer than the model's window at
    positions it never saw; they refuse it now as `generate` does, and score it with rolling positions."""
    from kvjax import fewshot
    from kvjax.fewshot import Item
    from kvjax.scoring import chunked_logprobs, perplexity
    from kvjax.models.tiny import make_random_checkpoint, tiny_config

    model = load(make_random_checkpoint(tmp_path / "m", tiny_config(max_position_embeddings=64), seed=0)).model
    ids = np.random.default_rng(0).integers(4, model.cfg.vocab_size, 100).tolist()
    with pytest.raises(InvalidInput, match=r"a text of 100 tokens .* past the model's max_position_embeddings=64"):
        perplexity(model, ids, StreamingLLM(budget=32))
    with pytest.raises(InvalidInput, match="positions='rolling'"):
        chunked_logprobs(model, ids, StreamingLLM(budget=32, prefill_mode="chunked", chunk=16))
    assert np.isfinite(perplexity(model, ids, StreamingLLM(budget=32, positions="rolling")))
    with pytest.raises(InvalidInput, match="past the model's max_position_embeddings"):
        fewshot.prefix_cache(model, ids, FullCache(), 8)
    with pytest.raises(InvalidInput, match="past the model's max_position_embeddings"):
        fewshot.full_scores(model, ids, Item((5,), ((6,), (7,)), 0))


@pytest.mark.parametrize("bad, message", [
    ([5, 6, -3], r"token id -3 is outside the vocabulary \[0, 260\)"),
    ([5, 6, 260], r"token id 260 is outside the vocabulary"),
    ([5, 6.0, 7], r"token ids must be integers, got float 6.0"),
    ([5, "6", 7], r"token ids must be integers, got str '6'"),
    ([5, True, 7], r"token ids must be integers, got bool True"),
])
def test_cli_error_api_validates_token_ids_at_the_boundary(tiny, bad, message):
    """An id out of range once read -3 as vocab - 3 (a perplexity of 4.75) or raised a NonFiniteError that
    blamed the weights; floats and strings were coerced with int(). One clear error instead, everywhere."""
    from kvjax.scoring import perplexity

    assert tiny.config.vocab_size == 260
    with pytest.raises(InvalidInput, match=message):
        perplexity(tiny.model, bad, StreamingLLM(budget=32))
    with pytest.raises(InvalidInput, match=message):
        generate(tiny.model, [bad], FullCache(), max_new_tokens=2)


def test_cli_error_api_generate_arguments(tiny):
    """generate's pad id, its policy argument, a 2-D array of prompts and a sampled call without a key."""
    import jax

    ids = [5, 6, 7, 8]
    with pytest.raises(InvalidInput, match=r"pad_id: token id 1000000 is outside the vocabulary"):
        generate(tiny.model, [ids], FullCache(), max_new_tokens=2, pad_id=10**6)
    with pytest.raises(InvalidInput, match=r"expected a kvjax Policy object .* got str 'streaming'; "
                                           r"kvjax.policies.make_policy\('streaming', budget\)"):
        generate(tiny.model, [ids], "streaming")
    with pytest.raises(InvalidInput, match="pass a list of prompts, e.g. \\[ids\\]"):
        generate(tiny.model, ids, FullCache())
    rows = np.asarray([ids, [9, 10, 11, 12]], np.int32)
    out = generate(tiny.model, rows, FullCache(), max_new_tokens=3)  # a 2-D array: one prompt per row
    assert out.tokens.shape[0] == 2
    assert out.tokens.tolist() == generate(tiny.model, [ids, [9, 10, 11, 12]], FullCache(), max_new_tokens=3).tokens.tolist()
    with pytest.raises(InvalidInput, match="needs a key"):
        generate(tiny.model, [ids], FullCache(), max_new_tokens=2, sampling=Sampling(temperature=0.7))
    a = generate(tiny.model, [ids], FullCache(), max_new_tokens=8, sampling=Sampling(temperature=2.0),
                 key=jax.random.key(1))
    assert a.tokens.shape == (1, 8)


def test_cli_error_degenerate_parameters_are_refused_or_marked(tiny_dir, tmp_path):
    """MAT whose shallow layers are all of the model's is StreamingLLM (the perplexity suite's default
    comparison printed MAT = StreamingLLM on the 2-layer default model): refused, and the default L_s is the
    paper's 2 of 32 scaled to the depth. PyramidKV below kvpress's pyramid (budget < window (beta + 1)) is
    SnapKV in every layer: warned where built and marked under every table it appears in."""
    from kvjax.experiments import driver
    from kvjax.experiments.longbench import __main__ as lb
    from kvjax.policies import PyramidKV, make_policy, mat, reduces_to

    lm = driver.load_model(tiny_dir)
    with pytest.raises(InvalidInput, match=r"split \(shallow layers L_s\)=2 puts all 2 layers of the model in "
                                           r"StreamingLLM"):
        drive.plan(lm.model, mat(64, 16, shallow_layers=2))
    assert make_policy("mat", 64, num_layers=2).split == 1  # round(2 * 2 / 32) = 0, at least 1, below 2
    assert make_policy("mat", 64, num_layers=32).split == 2
    with pytest.warns(UserWarning, match=r"SnapKV in every layer: kvpress's pyramid needs budget >= "
                                         r"observation_window \* \(beta \+ 1\) = 672"):
        pyr = PyramidKV(budget=256, num_layers=2)
    assert reduces_to(pyr) is not None and reduces_to(PyramidKV(budget=1024, num_layers=2)) is None
    res = lb.suite(lm, {"pyramidkv": PyramidKV(budget=64, observation_window=4, beta=20, num_layers=2)},
                   tmp_path / "lb", datasets=["stdlib_passkey"], samples=1, progress=False)
    assert "**Note:** `pyramidkv` is SnapKV in every layer" in res.table
    assert "**Note:** `pyramidkv`" in (tmp_path / "lb" / "results.md").read_text()
    with pytest.raises(InvalidInput, match=r"samples=-1 must be a positive integer"):
        lb.suite(lm, {"full": FullCache()}, tmp_path / "lb2", samples=-1, progress=False)


@pytest.mark.parametrize("line, message", [
    ('{"context": "", "query": "q", "choices": ["a", "b"], "gold": 1.7}', r"gold=1.7 must be an integer"),
    ('{"context": "", "query": "q", "choices": ["a", "b"], "gold": true}', r"gold=True must be an integer"),
    ('{"context": "", "query": "q", "choices": "ab", "gold": 0}', r"choices must be a list of at least 2 strings"),
    ('{"context": "", "query": "q", ', r":1: not valid JSON"),
    ('[1, 2]', r"an item is a JSON object, got list"),
])
def test_cli_error_zero_shot_data_is_validated(tmp_path, line, message):
    from kvjax.experiments import zeroshot

    f = tmp_path / "d.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(InvalidInput, match=message):
        zeroshot.read_items(str(f))
    f.write_bytes(b"\xff\xfe bad")
    with pytest.raises(InvalidInput, match="not a UTF-8 text file"):
        zeroshot.read_items(str(f))


def _claim_in_child(out: Path, model_dir: Path, hold: float) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import time
        from kvjax.experiments.records import claim_results_dir
        from kvjax.models import load
        claim_results_dir({str(out)!r}, load({str(model_dir)!r}), {{}})
        print("claimed", flush=True)
        time.sleep({hold})
    """)
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_lock_a_second_run_on_the_same_out_is_refused_naming_the_holder(tiny_dir, tmp_path):
    """Two runs into one --out once both computed everything (36 lines for 18 records): the first holds
    an exclusive lock for its life, and the second is refused in one line naming the holding process."""
    out = tmp_path / "out"
    child = _claim_in_child(out, tiny_dir, hold=30)
    try:
        assert child.stdout.readline().strip() == "claimed"
        with pytest.raises(InvalidInput, match=rf"--out {out} is in use by pid {child.pid} on .* since "):
            claim_results_dir(out, load(tiny_dir), {})
    finally:
        child.kill()
        child.wait()
    claim_results_dir(out, load(tiny_dir), {})  # the holder is gone: the lock went with it


def test_lock_and_identity_never_write_into_the_users_directory(tiny_dir, tmp_path):
    """--out naming the user's own directory (files, no identity.json) or a file is refused before anything
    is written; an OUT whose claim was written by a run that stopped before its first record takes the new
    configuration instead of refusing it."""
    lm = load(tiny_dir)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.md").write_text("my notes\n")
    with pytest.raises(InvalidInput, match=r"holds files kvjax did not write \(results.md\) and no identity.json"):
        claim_results_dir(mine, lm, {})
    assert sorted(p.name for p in mine.iterdir()) == ["results.md"]  # nothing written
    (tmp_path / "afile").write_text("x")
    with pytest.raises(InvalidInput, match="is a file, not a directory"):
        claim_results_dir(tmp_path / "afile", lm, {})
    empty = tmp_path / "fresh"
    claim_results_dir(empty, lm, {"--seed": 0})
    claim_results_dir(empty, lm, {"--seed": 1})  # nothing recorded under seed 0: replaced, not refused
    assert json.loads((empty / "identity.json").read_text())["--seed"] == 1


def test_atomic_outputs_never_default_to_a_committed_path(capsys):
    """`small_card` once rewrote kvjax/models/small/README.md and eval.json by default (a 1-sample run replaced the
    committed card) and `train_small --from X` without --out trained into kvjax/models/small: the cards write into
    results/ unless told otherwise, and train_small needs an --out."""
    from kvjax.experiments import model_card, small_card, train_small

    for main, default in ((small_card.main, "results/small_card"), (model_card.main, "results/model_card")):
        with pytest.raises(SystemExit):
            main(["--help"])
        assert f"(default: {default})" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        train_small.parse(["--from", "kvjax/models/small", "--extend-steps", "5"])
    assert "the following arguments are required: --out" in capsys.readouterr().err


def test_atomic_every_table_file_goes_through_a_temporary_file(tiny_dir, tmp_path, monkeypatch):
    """results.csv (perplexity, RULER, LongBench) and the report's report.md were written in place, so a kill
    mid-write left a torn table; every one of them is now replaced whole (`write_atomic`)."""
    from kvjax.experiments import driver, perplexity, records

    written = []
    real = records.write_atomic

    def spy(path, text):
        written.append(Path(path).name)
        return real(path, text)

    monkeypatch.setattr(records, "write_atomic", spy)
    lm = driver.load_model(tiny_dir)
    perplexity.suite(lm, {"full": FullCache()}, tmp_path / "ppl", lengths=[32], text=None, progress=False)
    assert "results.csv" in written
    import kvjax.experiments.report as report

    monkeypatch.setattr(report, "write_atomic", spy)
    written.clear()
    # every section skipped (the quantization section, added later, had been left running: 3.5 minutes of it)
    assert report.main(["--model", str(tiny_dir), "--skip",
                        "perplexity,razor,longbench,ruler,zeroshot,passkey,efficiency,quantization",
                        "--out", str(tmp_path / "rep")]) == 0
    assert "report.md" in written


def test_cli_error_files_and_faults_end_in_one_line(tiny_dir, tmp_path, capsys):
    """Round 3's probes that ended in a traceback: a read-only --out, --out naming a file, garbage in a cached
    RULER sample file, a non-UTF-8 --text, a config nested 200,000 deep or with a negative size, a config of
    100,000 layers over a 2-layer checkpoint (refused before anything is built), --policy gate without
    --gate-params (exit 2, not 1), a --gate-params directory without gate.json, and report --anllm DIR
    missing (found before any section runs). Each is one `error:` line with exit status 2."""
    import shutil

    from kvjax.experiments import perplexity, report
    from kvjax.experiments.ruler import __main__ as ruler_cli

    def one(main, argv):
        code, err = run_cli(main, argv, capsys)
        assert code == 2, err
        return one_error_line(err)

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root ignores permissions: nothing to test
        ro.chmod(0o700)
    else:
        assert "cannot be written" in one(passkey.main, ["--model", str(tiny_dir), "--out", str(ro / "x"),
                                                         "--lengths", "300", "--samples", "1"])
    (tmp_path / "f").write_text("x")
    assert "is a file, not a directory" in one(passkey.main, ["--model", str(tiny_dir), "--out", str(tmp_path / "f"),
                                                              "--lengths", "300", "--samples", "1"])
    out = tmp_path / "ruler"
    argv = ["--model", str(tiny_dir), "--tasks", "niah_single_1", "--lengths", "1024", "--samples", "1",
            "--max-new-tokens", "8", "--compare", "full", "--out", str(out)]
    assert ruler_cli.main(argv) == 0
    capsys.readouterr()
    (out / "data" / "niah_single_1-1024.jsonl").write_text("garbage\n")
    assert "is not a sample file kvjax wrote" in one(ruler_cli.main, argv)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfa text")
    assert "is not UTF-8 text" in one(perplexity.main, ["--model", str(tiny_dir), "--text", str(bad), "--out",
                                                         str(tmp_path / "p")])
    for name, cfg in (("deep", "[" * 200_000 + "]" * 200_000),
                      ("negative", json.dumps({**json.loads((tiny_dir / "config.json").read_text()), "hidden_size": -4})),
                      ("layers", json.dumps({**json.loads((tiny_dir / "config.json").read_text()),
                                             "num_hidden_layers": 100_000}))):
        d = tmp_path / name
        shutil.copytree(tiny_dir, d)
        (d / "config.json").write_text(cfg)
        line = one(gen_cli.main, ["--model", str(d), "hello"])
        assert {"deep": "nests too deeply", "negative": "hidden_size=-4 must be a positive integer",
                "layers": "has 2 layers, its config 100000"}[name] in line, line
    assert "--policy gate needs --gate-params" in one(passkey.main, ["--model", str(tiny_dir), "--policy", "gate",
                                                                     "--out", str(tmp_path / "g")])
    (tmp_path / "nogates").mkdir()
    assert "gate.json not found" in one(passkey.main, ["--model", str(tiny_dir), "--policy", "gate", "--gate-params",
                                                       str(tmp_path / "nogates"), "--out", str(tmp_path / "g2")])
    with pytest.raises(SystemExit) as exit_:
        report.main(["--model", str(tiny_dir), "--anllm", str(tmp_path / "nope"), "--out", str(tmp_path / "rep")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--anllm" in err and "no results.md there" in err
    assert not (tmp_path / "rep" / "perplexity").exists()  # refused before any section ran


def test_cli_error_ctrl_c_is_one_line_and_keeps_the_records(tiny_dir, tmp_path, capsys, monkeypatch):
    """Ctrl-C during a suite once printed 30 lines of traceback: one line now, exit 130, and the records
    finished before it are kept (the rerun resumes from them)."""
    out = tmp_path / "pk"
    argv = ["--model", str(tiny_dir), "--lengths", "300", "--depths", "0,0.5,1", "--samples", "1", "--out", str(out)]
    real = passkey.ResultLog.add
    calls = []

    def add_then_interrupt(self, record):
        real(self, record)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(passkey.ResultLog, "add", add_then_interrupt)
    code, err = run_cli(passkey.main, argv, capsys)
    assert code == 130 and "Traceback" not in err and err.count("interrupted:") == 1
    assert "interrupted: the records finished so far are kept; run the same command again to resume\n" in err
    assert len((out / "samples.jsonl").read_text().splitlines()) == 2


def test_cli_error_absurd_chunk_is_capped_not_allocated(tiny_dir, tmp_path, capsys):
    """`--chunk 100000` once asked for 480 GB and `--chunk 10**9` aborted the process in C++: a chunk longer
    than the prompt reads it whole either way, so it is capped (the prompt, or the model's window) and the
    result is that of a chunk holding the prompt."""
    from kvjax.scoring import chunked_logprobs

    lm = load(tiny_dir)
    ids = np.random.default_rng(1).integers(4, lm.config.vocab_size, 60).tolist()
    big = chunked_logprobs(lm.model, ids, StreamingLLM(budget=32, prefill_mode="chunked", chunk=10**9))
    fit = chunked_logprobs(lm.model, ids, StreamingLLM(budget=32, prefill_mode="chunked", chunk=64))
    np.testing.assert_allclose(big, fit, atol=1e-5)
    g = generate(lm.model, [ids], SnapKV(budget=16, observation_window=4, prefill_mode="chunked", chunk=100_000),
                 max_new_tokens=4)
    h = generate(lm.model, [ids], SnapKV(budget=16, observation_window=4, prefill_mode="chunked", chunk=64),
                 max_new_tokens=4)
    assert g.tokens.tolist() == h.tokens.tolist()
    assert gen_cli.main(["--model", str(tiny_dir), "--policy", "streaming", "--budget", "32", "--prefill-mode",
                         "chunked", "--chunk", str(10**9), "hello there"]) == 0


def test_cli_error_h2o_budget_of_one_names_only_what_was_given(tiny_dir, capsys):
    """`--policy h2o --budget 1` once said the budget "must exceed --recent 1", a flag the user never gave."""
    code, err = run_cli(gen_cli.main, ["--model", str(tiny_dir), "--policy", "h2o", "--budget", "1", "hi"], capsys)
    line = one_error_line(err)
    assert code == 2 and "--budget 1 must be >= 2" in line and "--recent" not in line
    from kvjax.policies import H2O, make_policy

    assert make_policy("h2o", 256) == H2O(budget=256, recent=128)  # the default split, spelled in the description
