"""kvjax compiled for TPU by libtpu's own compiler, on this CPU (`kvjax.tpu`, `benchmarks.tpu_aot`).

Interpret mode and `jax.export(platforms=["tpu"])` accept programs that Mosaic rejects (operand types and
precision of its matmuls, layouts, SMEM / VMEM sizes); only a real compile sees them. Each chip is compiled for
in a subprocess started with libtpu's offline variables and, where possible, no network namespace at all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvjax import tpu

pytestmark = pytest.mark.skipif(tpu.unavailable() is not None, reason=f"TPU compile: {tpu.unavailable()}")

ROOT = Path(__file__).resolve().parent.parent
CHIPS = ("v5e", "v6e")
KERNELS = {"decode", "prefill", "colsum", "pool_decode", "quant_decode", "splash"}


# v6e's kernel set compiles in about 3.5 minutes on 2 cores (v5e's in 1.5): the same kernels and shapes, so the
# default suite compiles them for v5e and `pytest -m slow` for v6e too
@pytest.fixture(scope="module", params=[CHIPS[0], pytest.param(CHIPS[1], marks=pytest.mark.slow)])
def kernel_rows(request, tmp_path_factory):
    from benchmarks import tpu_aot

    records = tmp_path_factory.mktemp("tpu") / "records.jsonl"
    return request.param, tpu_aot.run_chip(request.param, list(tpu_aot.kernel_specs(quick=True)), records, timeout=900)


def test_tpu_every_mosaic_kernel_compiles_in_both_dtypes(kernel_rows):
    chip, rows = kernel_rows
    failed = [f"{r['kernel']}[{r['shape']}]: {r['error']}" for r in rows if not r["ok"]]
    assert not failed, f"{chip}: {len(failed)} of {len(rows)} kernels do not compile:\n" + "\n".join(failed)
    seen = {(r["kernel"], r["shape"].split()[0]) for r in rows}
    assert seen == {(k, dt) for k in KERNELS for dt in ("f32", "bf16")}, seen
    # the compiler's memory analysis is real: a bf16 decode over 128K slots at batch 8 takes its K and V as
    # arguments, 2 x 8 x 8 x 131072 x 128 x 2 bytes = 4 GiB
    big = next(r for r in rows if r["kernel"] == "decode" and r["shape"] == "bf16 b8 C131072")
    assert 4 * tpu.GiB <= big["argument_bytes"] < 4.1 * tpu.GiB
    # a cache that is no whole number of 512-slot tiles (a 4K prompt and 256 new tokens) is not copied into a
    # padded one at every step: XLA's own traffic is a sliver of the cache (a padded copy reads and writes it all,
    # 4x its bytes; the kernel's reads are the custom call's, outside XLA's count)
    for r in rows:
        if r["kernel"] == "decode" and " C4352" in r["shape"]:
            assert r["bytes_accessed"] < 0.2 * r["argument_bytes"], r


def _compile_script(precision_for_bf16: str) -> str:
    return textwrap.dedent(f"""
        import jax, jax.numpy as jnp
        from kvjax import tpu
        from kvjax.pallas import tiles
        if {precision_for_bf16!r} == "highest":  # the code before the fix: HIGHEST whatever the operands
            tiles.precision = lambda a, b: jax.lax.Precision.HIGHEST
        from benchmarks import tpu_aot
        devices = tpu.topology("v5e").devices
        row = tpu_aot.compile_case(tpu_aot.decode_case("bf16", 4096, 1, False), devices, "v5e")
        print("OK" if row["ok"] else row["error"])
    """)


@pytest.mark.parametrize("precision", ["per-dtype", "highest"])
def test_tpu_bf16_kernels_need_default_precision(precision):
    """The failure this fixes, reproduced: Mosaic refuses an f32-precision contraction of bf16 operands."""
    env = {**os.environ, **tpu.offline_env("v5e"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(tpu.offline_command([sys.executable, "-c", _compile_script(precision)]), env=env,
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    if precision == "highest":
        assert "Mosaic failed to compile TPU kernel" in last and "Bad lhs type" in last, last
    else:
        assert last == "OK", last


def test_tpu_topology_refuses_without_offline_variables(monkeypatch):
    for k in tpu.offline_env("v5e"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="offline variables"):
        tpu.topology("v5e")


@pytest.mark.slow  # over 20 s on 2 cores (issue 88: the default suite within 15 minutes)
def test_tpu_whole_model_compiles_under_every_policy(tmp_path):
    """kvjax's Llama at Llama-3.2-1B widths (2 of its 16 layers, bf16, attention_impl="pallas") compiled for v5e:
    the prompt pass under SnapKV, one decode step under FullCache, SnapKV, RazorAttention's head groups,
    AdaKV's pool and a 4-bit cache, KVzip's replay of a 2048-token chunk, and a question read into SnapKV's cache in
    one forward and into AdaKV's token by token. The full-depth tables are `benchmarks/results/tpu_aot_*.md`."""
    from benchmarks import tpu_aot

    specs = [["model", "llama-1b", "snapkv", "prefill", 1, 2048, 2]]
    specs += [["model", "llama-1b", p, "step", 1, 2048, 2] for p in tpu_aot.POLICIES]
    # 4 chips, the kernels under shard_map; RazorAttention's 2-head retrieval group does not split 4 ways
    specs += [["model-tp", "llama-1b", p, "step", 1, 2048, 2] for p in ("full", "razor")]
    specs += [["model", "llama-1b", "kvzip", "replay", 1, 2048, 2]]  # its attention in XLA (`replay_attention`)
    # the agnostic protocol's question: one forward (`kvjax.step.Append`) under SnapKV, token by token under AdaKV
    specs += [["model", "llama-1b", p, "question", 1, 2048, 2] for p in ("snapkv", "adakv")]
    # scanned programs at twice the depth: their temporaries must not grow by the added layers' weights
    specs += [["model", "llama-1b", "snapkv", p, 1, 2048, 4] for p in ("prefill", "question")]
    rows = tpu_aot.run_chip("v5e", specs, tmp_path / "records.jsonl", timeout=900)
    failed = [f"{r['kernel']}[{r['shape']}]: {r['error']}" for r in rows if not r["ok"]]
    assert not failed and len(rows) == len(specs), failed
    # each row names the machine that compiled it (its compile seconds compare only on that machine): the worker
    # process's description of this CPU, "<model name> (family F, model M), N cores" on x86
    from benchmarks import timing
    host = timing.machine()
    assert {r.get("host") for r in rows} == {host} and host.endswith(f", {timing.cores()} cores")
    by = {(r["spec"][2], r["spec"][3]): r for r in rows if r["spec"][0] == "model" and r["spec"][6] == 2}
    tp = next(r for r in rows if r["spec"][0] == "model-tp" and r["spec"][2] == "full")
    # the decode step reads every parameter once: 2 layers of a 1B model's widths and the tied embedding
    cfg = tpu_aot.model_config("llama-1b", 2)
    layer = (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
             + cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size)
    params = 2 * (2 * layer + cfg.vocab_size * cfg.hidden_size)  # bf16
    full = by[("full", "step")]
    # (XLA's count also holds the embedding gather as a read of the whole table, so there is no tight upper bound)
    assert params <= full["bytes_accessed"]
    # tensor parallel: each chip holds the replicated embedding and a quarter of the layers' weights and cache
    layers_and_cache = full["argument_bytes"] - 2 * cfg.vocab_size * cfg.hidden_size
    assert tp["argument_bytes"] < full["argument_bytes"] - 0.7 * layers_and_cache
    # a 4-bit cache holds fewer bytes than the full one at the same length (codes, scales and a residual)
    assert by[("full-4bit", "step")]["argument_bytes"] < full["argument_bytes"]
    # A scanned run picks each layer's parameters (`kvjax.models.llama.stacks_parameters`) rather than stacking them: a
    # stack is a copy of every layer's weights in the program: with it, the prompt pass's temporaries grew by 228 MiB
    # from 2 to 4 layers (about the 2 added layers' weights, 2 x 116 MiB); with the pick, by a few MiB.
    deeper = {r["spec"][3]: r for r in rows if r["spec"][0] == "model" and len(r["spec"]) > 6 and r["spec"][6] == 4}
    for program in ("prefill", "question"):
        grown = deeper[program]["temp_bytes"] - by[("snapkv", program)]["temp_bytes"]
        assert grown < 0.5 * 2 * layer, (program, grown)
