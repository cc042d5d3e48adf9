"""The benchmark scripts' command lines (their numbers are for reading, never asserted). Those that refuse a CPU
table on a busy machine run with --allow-load: the test suite keeps the machine busy (`tests/test_benchmark_timing.py`
tests the refusal)."""

import json
from pathlib import Path

import pytest

from benchmarks import e2e


def test_e2e_refuses_an_unknown_policy_by_name(capsys):
    with pytest.raises(SystemExit) as exc:
        e2e.main(["--policies", "full,streamingllm", "--no-torch", "--compile-layers", ""])
    assert exc.value.code == 2
    assert "--policies: unknown ['streamingllm']" in capsys.readouterr().err


def test_e2e_runs_only_the_chosen_policies_and_names_its_files_by_shape(tmp_path):
    e2e.main(["--shape", "issue25", "--lengths", "64", "--batches", "1", "--new", "4", "--budget", "32",
              "--policies", "streaming", "--no-torch", "--compile-layers", "", "--repeats", "2",
              "--out", str(tmp_path), "--allow-load"])
    record = json.loads((tmp_path / "e2e_cpu_issue25.json").read_text())
    assert [(r["impl"], r["policy"], r["prompt"]) for r in record["rows"]] == [("kvjax", "streaming", 64)]
    (row,) = record["rows"]  # the median of the repeats, with their range, and the load around the run
    assert row["ttft_s_min"] <= row["ttft_s"] <= row["ttft_s_max"]
    assert row["decode_tok_s_min"] <= row["decode_tok_s"] <= row["decode_tok_s_max"]
    assert len(record["load"]["before"]) == len(record["load"]["after"]) == 3 and record["meta"]["repeats"] == 2
    assert (tmp_path / "e2e_cpu_issue25.md").read_text().rstrip().splitlines()[-1].startswith("Load average")
    assert record["meta"]["config"]["hidden_size"] == 256
    # the decode roofline: the weights a step reads, counted by hand from the issue25 shape (float32, untied head):
    # per layer q 256x256, k and v 256x64 each, o 256x256, the MLP 3 x 256x768, two norms of 256; 4 layers, the
    # embedding and the head 8192x256 each, the final norm
    layer = 256 * 256 + 2 * 256 * 64 + 256 * 256 + 3 * 256 * 768 + 2 * 256
    assert record["meta"]["weight_bytes"] == 4 * (4 * layer + 2 * 8192 * 256 + 256)
    meta = record["meta"]
    assert meta["read_bytes_s_min"] <= meta["read_bytes_s"] <= meta["read_bytes_s_max"]
    assert row["roofline_tok_s"] == pytest.approx(meta["read_bytes_s"] / (meta["weight_bytes"] + row["cache_bytes"]))
    assert "decode, % of roofline" in (tmp_path / "e2e_cpu_issue25.md").read_text()
    assert (tmp_path / "e2e_cpu_issue25.md").exists() and (tmp_path / "e2e_cpu_issue25.png").exists()
    assert not (tmp_path / "e2e_cpu.json").exists()


def test_attention_decode_rows_count_every_rows_cache_and_refuse_an_unknown_dtype(tmp_path, capsys):
    from benchmarks import attention

    with pytest.raises(SystemExit) as exc:
        attention.main(["--decode-dtypes", "bfloat16,fp8", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--decode-dtypes: ['fp8']" in capsys.readouterr().err
    attention.main(["--decode", "128", "--decode-batches", "1,2", "--decode-dtypes", "float32", "--prefill", "128",
                    "--masked", "0", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "attention_cpu.json").read_text())["decode"]
    assert [(r["batch"], r["dtype"], r["C"]) for r in rows] == [(1, "float32", 128), (2, "float32", 128)]
    # bytes read = GB/s x µs: K and V of each row, 2 x 8 heads x 128 slots x d 128 x 4 bytes per row
    for r in rows:
        assert r["xla_GBps"] * r["xla_us"] * 1e3 == pytest.approx(r["batch"] * 2 * 8 * 128 * 128 * 4)


@pytest.mark.slow
def test_quant_benchmark_writes_its_tables_and_bytes_fall_with_the_width(tmp_path, capsys):
    from benchmarks import quant

    with pytest.raises(SystemExit):
        quant.main(["--widths", "16,3", "--out", str(tmp_path)])
    assert "--widths: [3]" in capsys.readouterr().err
    quant.main(["--lengths", "1024", "--steps", "2", "--repeats", "1", "--out", str(tmp_path), "--allow-load"])
    rows = json.loads((tmp_path / "quant_cpu.json").read_text())["rows"]
    assert [r["bits"] for r in rows] == [16, 8, 4, 2]
    kv = [r["cache_bytes"] for r in rows]
    assert kv == sorted(kv, reverse=True)  # 16 > 8 > 4 > 2 bits, the 128-token residual included, at 1024 tokens
    assert (tmp_path / "quant_cpu.md").is_file() and (tmp_path / "quant_cpu.png").is_file()


@pytest.mark.slow
def test_adakv_benchmark_writes_its_tables_and_measures_the_pooled_bytes(tmp_path):
    """kvjax's AdaKV pools its heads' slots: the benchmark's bytes are SnapKV's at the same per-head budget, each
    slot's int32 head index in place of SnapKV's float32 log-weight (`kvjax.cache.LayerCache.log_w`; SnapKV carries
    no statistic since per-rule state), and under a third of the full cache's at 1024 tokens; 2 KV heads x 4
    layers x (256 + a slot for each of the 8 new tokens) slots of 2 x 32 float32 keys and values plus 8 bytes."""
    from benchmarks import adakv
    from benchmarks.decode import BENCH_CONFIG

    adakv.main(["--lengths", "1024", "--new", "8", "--repeats", "1", "--out", str(tmp_path), "--allow-load"])
    rows = {r["policy"]: r for r in json.loads((tmp_path / "adakv_cpu.json").read_text())["rows"]}
    assert set(rows) == {"full", "snapkv256", "adakv256"}
    slots = BENCH_CONFIG["num_layers"] * BENCH_CONFIG["num_kv_heads"] * (256 + 8)
    assert rows["snapkv256"]["cache_bytes"] == rows["adakv256"]["cache_bytes"] == slots * (2 * 4 * BENCH_CONFIG["head_dim"] + 8)
    assert rows["adakv256"]["cache_bytes"] < rows["full"]["cache_bytes"] / 3
    assert (tmp_path / "adakv_cpu.md").is_file() and (tmp_path / "adakv_cpu.png").is_file()


def test_kvzip_benchmark_writes_its_table_and_counts_the_replays(tmp_path):
    """On the embedded model at 300 tokens: one replay of the 300 context tokens plus kvpress's prompt and the
    suffix, and every time finite and positive."""
    from benchmarks import kvzip as bench
    from kvjax.experiments.common import DEFAULT_MODEL_DIR
    from kvjax.kvzip import replay_prompts
    from kvjax.models.loading import load_tokenizer

    bench.main(["--lengths", "300", "--repeats", "1", "--out", str(tmp_path), "--allow-load"])
    (row,) = json.loads((tmp_path / "kvzip_cpu.json").read_text())["rows"]
    prompts = replay_prompts(load_tokenizer(DEFAULT_MODEL_DIR))
    assert row["replays"] == 1 and row["replay_tokens"] == 300 + len(prompts["repeat_ids"]) + len(prompts["suffix_ids"])
    assert all(row[k] > 0 for k in ("prefill_s", "replay_s", "snapkv_s"))
    assert "| 300 |" in (tmp_path / "kvzip_cpu.md").read_text()


@pytest.mark.slow  # over 20 s on 2 cores (issue 88: the default suite within 15 minutes)
def test_compile_benchmark_times_cold_compiles_only(tmp_path):
    """The command turns the persistent compilation cache off before compiling anything, even with
    JAX_COMPILATION_CACHE_DIR set, so every repeat is a cold compilation; a process already using the cache (this
    suite's, set in conftest) is refused by name rather than timed on cache hits; the table holds one row per
    program."""
    import os
    import subprocess
    import sys

    from benchmarks import compile as bench
    from kvjax.experiments.common import DEFAULT_MODEL_DIR
    from kvjax.errors import InvalidInput
    from kvjax.models import load

    fn, args, kw = bench.program(load(DEFAULT_MODEL_DIR), "prefill full", 32)
    with pytest.raises(InvalidInput, match="persistent compilation cache"):
        for _ in range(2):  # the second at the latest is a hit in this process
            bench.compile_seconds(fn, args, kw)
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    run = subprocess.run([sys.executable, "-m", "benchmarks.compile", "--programs", "prefill full,shared pass of 2",
                          "--length", "32", "--repeats", "2", "--out", str(tmp_path), "--allow-load"],
                         cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    rows = json.loads((tmp_path / "compile_cpu.json").read_text())["rows"]
    assert [(r["program"], r["layer_loop"]) for r in rows] == [
        (p, loop) for loop in ("unroll", "scan") for p in ("prefill full", "shared pass of 2")]
    assert all(r["compile_s_min"] > 0 and r["lower_s"] > 0 and r["run_s_min"] > 0 for r in rows)
    table = (tmp_path / "compile_cpu.md").read_text()
    assert "| shared pass of 2 |" in table and "| compile s (unroll) | compile s (scan) | run s (unroll) |" in table
    assert all(r["run_peak_rss_gb"] is None or r["run_peak_rss_gb"] >= 0 for r in rows)


def test_compile_benchmark_batches_the_prompt_programs_and_refuses_a_batched_decode_loop():
    """`--batch N`: the prompt passes read N prompt rows; the decode loop's arguments are one row's, so a batched
    decode loop is refused by name before anything loads."""
    from benchmarks import compile as bench
    from kvjax.experiments.common import DEFAULT_MODEL_DIR
    from kvjax.errors import InvalidInput
    from kvjax.models import load

    lm = load(DEFAULT_MODEL_DIR)
    for name in ("prefill full", "shared pass of 2"):
        _, args, _ = bench.program(lm, name, 32, 3)
        assert args[2].shape == (3, 32) and args[3].shape == (3, 32), name  # tokens, positions
        assert args[3][2].tolist() == list(range(32))
    with pytest.raises(InvalidInput, match="--batch 2"):
        bench.main(["--batch", "2", "--programs", "prefill full,decode loop", "--allow-load"])


def test_compile_benchmark_recaches_the_plans_of_the_shared_pass_it_is_compared_with():
    """"recache of N" times the same N plans as "shared pass of N", from a capture of the same prompts, and makes
    the caches that pass makes; "capture" is the pass with column sums."""
    import jax
    import numpy as np

    from benchmarks import compile as bench
    from kvjax.experiments.common import DEFAULT_MODEL_DIR
    from kvjax.errors import InvalidInput
    from kvjax.models import load

    lm = load(DEFAULT_MODEL_DIR)
    fn, args, kw = bench.program(lm, "recache of 3", 32, 2)
    pass_fn, pass_args, pass_kw = bench.program(lm, "shared pass of 3", 32, 2)
    assert kw["plans"] == pass_kw["plans"] and len(kw["plans"]) == 3
    for a, b in zip(jax.tree.leaves(fn(*args, **kw)), jax.tree.leaves(pass_fn(*pass_args, **pass_kw)[2]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert bench.program(lm, "capture", 32, 2)[2]["colsum"] is True
    with pytest.raises(InvalidInput, match="'recache of N' \\(N from 1 to 24\\)"):
        bench.main(["--programs", "recache of 0", "--allow-load"])


def test_memory_reads_a_childs_peak_from_the_kernel_and_refuses_a_malformed_cell(tmp_path, capsys):
    """A child that holds 300 MB peaks above 300 MB and one that holds nothing well below it, though the test
    process that starts both is larger than that: the kernel's own count for the child alone, not a sample; a
    cell that is not TOKENSxPROMPTS is one line, exit 2."""
    import os

    from benchmarks import memory
    from kvjax import cli

    (tmp_path / "hold.py").write_text("import sys\nb = bytearray(int(sys.argv[1]))\nb[::4096] = b'x' * len(b[::4096])\n"
                                      "raise SystemExit(int(sys.argv[2]))\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    big, small = (memory.peak_rss("hold", [str(n), "0"], env) for n in (300_000_000, 0))
    assert big > 300_000_000 > 3 * small
    with pytest.raises(RuntimeError, match="exited 3"):
        memory.peak_rss("hold", ["0", "3"], env)
    assert cli.run(memory.main, ["--model", "x", "--cells", "2048x1,8000", "--out", "o"]) == 2
    assert "--cells 2048x1,8000: not TOKENSxPROMPTS" in capsys.readouterr().err
