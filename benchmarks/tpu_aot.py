"""kvjax compiled for TPU v5e and v6e on a CPU-only machine: every Mosaic kernel, and the whole model sized.

    python -m benchmarks.tpu_aot                       # kernels and models, both chips -> benchmarks/results/
    python -m benchmarks.tpu_aot --chips v5e --only kernels --quick

Each chip is compiled for in its own subprocess started with libtpu's offline variables (`kvjax.tpu.offline_env`)
and, where the machine allows, with no network at all (`unshare -n`). Writes `tpu_aot_{chip}.{json,md}`: per
program and shape, compile seconds, argument / output / temporary bytes, whether it fits the chip's HBM, flops
and bytes accessed per call, and for a decode step the time those bytes take at the chip's HBM bandwidth (the
compiler's estimate, not a measurement: no TPU ran anything). Needs the `libtpu` wheel (the test extra pins it).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tqdm import tqdm

from benchmarks import timing
from benchmarks.tpu_tables import FIT_POINTS, largest_prompt, write_tables
from kvjax import cli, tpu
from kvjax.errors import InvalidInput
from kvjax import drive, engine
from kvjax.cli import HelpFormatter

RESULTS = Path(__file__).parent / "results"
TP_AXES = ("data", "model")  # kvjax.sharding's mesh axes: the batch over "data", whole heads over "model"
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Case:
    """One program to compile: `build(devices)` returns `(fn, args, static)` with abstract args placed on the first
    `chips` of the topology's devices (one chip, or a tensor-parallel mesh)."""

    kernel: str
    shape: str
    build: Callable
    chips: int = 1

    @property
    def name(self) -> str:
        return f"{self.kernel}[{self.shape}]"


# ---- the kernels, at the shapes kvjax runs them (an 8B-shaped layer: 32 query heads, 8 KV heads, d 128) ----

H, KVH, D = 32, 8, 128


def _sds(shape, dtype, device):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=tpu.on_device(device))


def decode_case(dtype: str, slots: int, batch: int, stats: bool) -> Case:
    from kvjax.pallas.decode import decode_attention
    from kvjax.stats import NO_STATS, StatsRequest

    def build(devices):
        dev = devices[0]
        dt = DTYPES[dtype]
        args = (_sds((batch, H, D), dt, dev), _sds((batch, KVH, slots, D), dt, dev),
                _sds((batch, KVH, slots, D), dt, dev), _sds((batch, KVH, slots), jnp.int32, dev),
                _sds((batch, KVH, slots), jnp.float32, dev))
        request = StatsRequest(probs=True, first_logit=True) if stats else NO_STATS
        return (lambda q, k, v, p, w: decode_attention(q, k, v, p, w, scale=D ** -0.5, stats=request,
                                                       variant="tpu")), args, {}

    return Case("decode", f"{dtype} b{batch} C{slots}{' stats' if stats else ''}", build)


def _prompt_mask(kind: str, batch: int, t: int, dev):
    from kvjax.masks import AnchorMask, Mask

    if kind == "causal":
        return Mask()
    if kind == "window":
        return Mask(window=4096)
    if kind == "anchors":  # AnLLM's eq. 4
        return Mask(anchors=AnchorMask(segment=_sds((batch, t), jnp.int32, dev), anchor=_sds((batch, t), jnp.bool_, dev),
                                       keep=_sds((batch, t), jnp.bool_, dev)))
    if kind == "gate":  # Attention-Gate's keep flags
        return Mask(key_keep=_sds((batch, KVH, t), jnp.bool_, dev))
    raise ValueError(kind)


MASKS = ("causal", "window", "anchors", "gate")


def prefill_case(dtype: str, t: int, mask: str, colsum: bool = False) -> Case:
    from kvjax.pallas import prefill as kernel

    def build(devices):
        dev = devices[0]
        dt = DTYPES[dtype]
        q, kv = _sds((1, H, t, D), dt, dev), _sds((1, KVH, t, D), dt, dev)
        pos = _sds((1, t), jnp.int32, dev)
        m = _prompt_mask(mask, 1, t, dev)
        if colsum:
            lse = _sds((1, H, t), jnp.float32, dev)
            return (lambda q, k, lse, p, m: kernel.colsum(q, k, lse, p, p, scale=D ** -0.5, mask=m, q_start=t - 64,
                                                          variant="tpu")), (q, kv, lse, pos, m), {}
        return (lambda q, k, v, p, m: kernel.prefill_attention(q, k, v, p, p, scale=D ** -0.5, mask=m,
                                                               variant="tpu")), (q, kv, kv, pos, m), {}

    return Case("colsum" if colsum else "prefill", f"{dtype} T{t} {mask}", build)


def pool_case(dtype: str, slots: int, batch: int) -> Case:
    """AdaKV's pooled decode: a pool of `slots` prompt slots shared by the layer's KV heads, 256 decode slots each."""
    from kvjax.cache import PooledLayerCache
    from kvjax.pallas import pool_decode

    def build(devices):
        dev = devices[0]
        dt, room = DTYPES[dtype], 256
        p = slots + KVH * room
        cache = PooledLayerCache(k=_sds((batch, p, D), dt, dev), v=_sds((batch, p, D), dt, dev),
                                 pos=_sds((batch, p), jnp.int32, dev), head=_sds((batch, p), jnp.int32, dev),
                                 num_kv_heads=KVH, room=room)
        return (lambda q, c: pool_decode.attend(q, c, scale=D ** -0.5, variant="tpu")), (
            _sds((batch, H, D), dt, dev), cache), {}

    return Case("pool_decode", f"{dtype} b{batch} P{slots}", build)


def quant_case(dtype: str, bits: int, slots: int, batch: int, stats: bool) -> Case:
    """The quantized-cache decode (`kvjax.pallas.quant_decode`): int8, or KIVI at 4 / 2 bits with groups of 32
    (`--kv-bits`' default group), a 128-token full-precision residual; `dtype` is the model's (scales, residual)."""
    from kvjax import quant
    from kvjax.pallas import quant_decode

    def build(devices):
        dev = devices[0]
        dt = DTYPES[dtype]
        spec = quant.KVQuant(bits, None if bits == 8 else 32, residual=128)
        qc = jax.eval_shape(lambda: quant.empty(spec, batch, KVH, slots, D, dt))
        qc = tpu.abstract(qc, tpu.on_device(dev))
        q, newest = _sds((batch, H, D), dt, dev), _sds((batch,), jnp.int32, dev)
        cur = (_sds((batch, KVH, D), dt, dev), _sds((batch, KVH, D), dt, dev))
        return (lambda q, qc, n, cur: quant_decode.attend(q, qc, n, cur, scale=D ** -0.5, probs=stats,
                                                          first_logit=stats, variant="tpu")), (q, qc, newest, cur), {}

    return Case("quant_decode", f"{dtype} {bits}-bit b{batch} C{slots}{' stats' if stats else ''}", build)


def splash_case(dtype: str, t: int, head_dim: int = D) -> Case:
    """jax's splash attention as kvjax calls it for a plain causal prompt on a TPU (`attention.splash_prefill`)."""
    from kvjax import attention

    def build(devices):
        dev = devices[0]
        dt = DTYPES[dtype]
        q, kv = _sds((1, H, t, head_dim), dt, dev), _sds((1, KVH, t, head_dim), dt, dev)
        return (lambda q, k, v, p: attention.splash_prefill(q, k, v, p, scale=head_dim ** -0.5)), (
            q, kv, kv, _sds((1, t), jnp.int32, dev)), {}

    return Case("splash", f"{dtype} T{t} d{head_dim}", build)


def kernel_specs(quick: bool = False) -> Iterator[list]:
    """Every Mosaic kernel in both dtypes. `quick` (the test suite's): the smallest shape of each axis that
    changes the program, plus the long ones where only the grid grows."""
    for dtype in DTYPES:
        for slots in (4096, 4352, 32768, 131072):  # 4352: a 4K prompt and 256 new tokens, not a whole 512-slot tile
            for batch in (1, 8):
                for stats in (False, True):
                    if quick and (slots, batch) not in ((4096, 1), (131072, 8), (4352, 1)):
                        continue
                    yield ["decode", dtype, slots, batch, stats]
        for slots in (4096, 32768):
            for batch in (1, 8):
                if not quick or (slots, batch) == (4096, 1):
                    yield ["pool", dtype, slots, batch]
        for bits in (8, 4, 2):
            for slots, batch in ((4352, 1), (32768, 8)):
                for stats in (False, True):
                    if not quick or (slots, batch) == (4352, 1):
                        yield ["quant", dtype, bits, slots, batch, stats]
        for t in (102400, 131072, 262144):  # past 64K tokens splash's tiles grow (`attention.splash_block`)
            if not quick or (t, dtype) == (102400, "bf16"):
                yield ["splash", dtype, t, 128]
        for t in (2048, 8192, 32768):
            for head_dim in (64, 128):
                if not quick or (t, head_dim) == (2048, 64):
                    yield ["splash", dtype, t, head_dim]
            for mask in MASKS:
                if quick and t != 2048 and mask != "causal":
                    continue
                yield ["prefill", dtype, t, mask]
                if not (quick and t == 32768):  # colsum's compile grows with T (25 s at 32K on 2 cores)
                    yield ["prefill", dtype, t, mask, True]


# ---- the whole model: kvjax's Llama at Llama-3.2-1B and Llama-3.1-8B shapes, random bf16 weights ----

SHAPES = {  # the published configs' shapes (vocabulary, widths, depth, heads, RoPE theta)
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                     num_kv_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                     num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
}
BUDGET = 4096  # slots per layer and KV head of the compressing policies (SnapKV, AdaKV's mean, Razor's local heads)
POLICIES = ("full", "snapkv", "razor", "adakv", "full-4bit")
NEW_TOKENS = 256  # the decode loop's token buffer
QUESTION = 64  # the question's bucket (a RULER question is under 64 tokens)


def model_config(shape: str, layers: int | None = None, max_len: int = 1 << 17):
    from kvjax.rope import RopeConfig
    from kvjax.models.llama import LlamaConfig

    spec = dict(SHAPES[shape], num_layers=layers or SHAPES[shape]["num_layers"])
    return LlamaConfig(**spec, max_position_embeddings=max_len, rms_norm_eps=1e-5, rope=RopeConfig(theta=500000.0),
                       bos_token_id=128000, eos_token_ids=(128001, 128009), attention_impl="pallas")


def make_policy(name: str, cfg):
    from kvjax.policies import AdaKV, FullCache, Quantized, RazorAttention, SnapKV

    if name == "full":
        return FullCache()
    if name == "snapkv":
        return SnapKV(budget=BUDGET)
    if name == "razor":  # the paper's 15 % of KV heads as retrieval heads (kvjax.heads finds them on a real model)
        per_layer = tuple(tuple(h < 2 for h in range(cfg.num_kv_heads)) for _ in range(cfg.num_layers))
        return RazorAttention(retrieval=per_layer, buffer=BUDGET)
    if name == "adakv":
        return AdaKV(scorer=SnapKV(budget=BUDGET))
    if name == "full-4bit":
        return Quantized(FullCache(), bits=4, group=32, residual=128)
    if name == "kvzip":  # the replay prompts' ids stand in for a tokenizer's (`kvjax.kvzip.replay_prompts`)
        from kvjax.policies import KVzip

        return KVzip(ratio=0.5, repeat_ids=(1, 2, 3), continue_ids=(4, 5), suffix_ids=(6,))
    raise ValueError(name)


def abstract_model(cfg, sharding):
    """kvjax's Llama with abstract bf16 parameters placed by `sharding` (nothing allocated): `(graphdef, state,
    model)`; `model` answers the plan's questions (its config), never computes."""
    from flax import nnx

    from kvjax.models.llama import Llama

    model = nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = engine.split(model)
    return graphdef, tpu.abstract(state, sharding), model


def _tp_sharding(mesh, chips: int):
    """Tensor parallelism over `chips` devices, as `kvjax.sharding.shard_model` places a model: `(params, heads)`,
    functions of (path, leaf) giving a parameter, or a cache array, its sharding: a cache array's axis 1 over
    "model" where it divides (its KV heads; AdaKV's pool, which has no head axis, is split along its slots and
    decodes in XLA on a mesh)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kvjax.sharding import MODEL, param_spec

    def name(k):
        return str(getattr(k, "key", getattr(k, "name", k)))

    def params(path, x):
        keys = tuple(name(k) for k in path if name(k) != "value")
        return NamedSharding(mesh, param_spec(keys, x.shape, chips))

    def heads(path, x):
        split = len(x.shape) >= 2 and x.shape[1] % chips == 0 and x.shape[1] >= chips
        return NamedSharding(mesh, P(None, MODEL) if split else P())

    return params, heads


def model_case(shape: str, policy: str, program: str, batch: int, prompt: int, layers: int | None = None, *,
               chips: int = 1) -> Case:
    """One whole-model program on one chip: `prefill` (the prompt pass, `kvjax.engine.prefill`), `prefill-xla`
    (the same with `attention_impl="xla"`), `step` (one decode step, `kvjax.engine.decode`), `loop` (the decode
    loop, `kvjax.generate.decode_fn`, 256 tokens), `question` (the agnostic protocol's question, `QUESTION` tokens
    read into the compressed cache, `kvjax.generate.question_fn`: one forward where the plan only appends while
    decoding, `kvjax.step.Append`, else token by token) or `replay` (KVzip's replay of `prompt` tokens against the
    cache of a `prompt`-token context, `kvjax.kvzip.replay_fn`; policy "kvzip")."""
    from kvjax import engine, kvzip
    from kvjax.generate import Sampling, decode_fn, question_fn
    from kvjax.layer import init_cache

    def build(devices):
        dev = devices[0]
        cfg = model_config(shape, layers)
        if program == "prefill-xla":  # the prompt pass through the jnp reference attention instead of the kernels
            cfg = dataclasses.replace(cfg, attention_impl="xla")
        if chips > 1:
            mesh = jax.sharding.Mesh(np.asarray(devices[:chips]).reshape(1, chips), TP_AXES)
            params, heads = _tp_sharding(mesh, chips)
            whole = tpu.replicated(mesh)
        else:
            whole = tpu.on_device(dev)
            params = heads = lambda path, x: whole  # noqa: E731
        graphdef, state, model = abstract_model(cfg, params)
        plan = drive.plan(model, make_policy(policy, cfg), prompt + NEW_TOKENS, prompt)

        def ints(*shape):
            return tpu.abstract(jax.ShapeDtypeStruct(shape, jnp.int32), whole)
        if program in ("prefill", "prefill-xla"):
            return engine.prefill.pure, (graphdef, state, ints(batch, prompt), ints(batch, prompt)), {"plan": plan}
        cache = jax.eval_shape(lambda: init_cache(plan, batch, cfg.num_kv_heads, cfg.head_dim, jnp.bfloat16))
        cache = tpu.abstract(cache, heads)
        if program == "step":
            return engine.decode.pure, (graphdef, state, ints(batch), ints(batch), cache), {"plan": plan}
        if program == "replay":
            return (kvzip.replay_fn.pure, (graphdef, state, ints(batch, prompt), ints(batch, prompt), cache, ints(batch, 3)),
                    {"plan": plan, "plus": False})
        key = tpu.abstract(jax.eval_shape(lambda: jax.random.key(0)), whole)
        if program == "question":
            return (question_fn.pure, (graphdef, state, cache, ints(batch, QUESTION), ints(batch, QUESTION), key),
                    {"plan": plan, "sampling": Sampling()})
        done = tpu.abstract(jax.ShapeDtypeStruct((batch,), jnp.bool_), whole)
        args = (graphdef, state, cache, ints(batch), done, ints(batch), key, ints(4), ints(), ints(), ints())  # eos, max_new, pad_id, reporter
        return decode_fn.pure, args, {"plan": plan, "sampling": Sampling(), "buffer": NEW_TOKENS}

    depth = f" {layers}L" if layers else ""
    tp = f" TP{chips}" if chips > 1 else ""
    return Case(f"{shape}{depth} {program}{tp}", f"{policy} b{batch} T{prompt}", build, chips)


# ---- running the cases for one chip, in this process (the worker) or in a subprocess (the driver) ----

CONSTRUCTORS = {"decode": decode_case, "prefill": prefill_case, "pool": pool_case, "quant": quant_case,
                "splash": splash_case, "model": model_case,
                "model-tp": functools.partial(model_case, chips=4)}  # tensor parallel over the 2x2 topology's 4 chips


def case_of(spec: list) -> Case:
    return CONSTRUCTORS[spec[0]](*spec[1:])


def compile_case(case: Case, devices, chip: str | None = None) -> dict:
    row = {"kernel": case.kernel, "shape": case.shape}
    try:
        fn, args, static = case.build(devices)
        with tpu.target(devices[:case.chips], TP_AXES, (1, case.chips)):
            compiled, seconds = tpu.compile(fn, *args, **static)
        row.update(ok=True, compile_s=round(seconds, 3), **tpu.analysis(compiled))
        if chip:  # the memory analysis is per device
            row["fits"] = tpu.CHIPS[chip].fits(row["peak_bytes"])
    except Exception as err:  # a program that does not compile is a result, reported with its first line
        first = str(err).strip().splitlines()[0][:300]
        row.update(ok=False, error=f"{type(err).__name__}: {first}", detail=traceback.format_exc(limit=2)[-2000:])
        if "RESOURCE_EXHAUSTED" in first and "hbm" in first.lower():  # the compiler's verdict: more than the chip holds
            row.update(fits=False)
    return row


def code_commit() -> str | None:
    """The checkout's short commit, with `+` if its tracked files other than the results have changes; None outside
    a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":!benchmarks/results"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty else "")


def worker(chip: str, specs: list[list], records: Path) -> None:
    """Compiles each spec not yet in `records` (a JSONL, one row appended and synced as each finishes, so a
    killed run resumes where it stopped)."""
    # done: compiled, or refused by the compiler for the chip's memory (a result); any other error is tried again
    done = {json.dumps(r["spec"]) for r in read_records(records) if r["chip"] == chip
            and (r["ok"] or r.get("fits") is False)}
    todo = [s for s in specs if json.dumps(s) not in done]
    if not todo:
        return
    devices = tpu.topology(chip).devices
    commit, host = code_commit(), timing.machine()
    for spec in tqdm(todo, desc=f"TPU {chip} compiles", unit="program"):
        load = os.getloadavg()[0]
        row = compile_case(case_of(spec), devices, chip) | {"chip": chip, "spec": spec}
        # compile seconds are CPU wall time: the 1-minute load average around each says whether others shared it
        row["load"] = round(max(load, os.getloadavg()[0]), 2)
        row["host"] = host  # and compile seconds compare only on one machine
        if commit:
            row["commit"] = commit
        with open(records, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_records(records: Path) -> list[dict]:
    if not records.exists():
        return []
    rows = []
    for line in records.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill: its program is compiled again
            continue
    return rows


def run_chip(chip: str, specs: list[list], records: Path, timeout: float = 3600) -> list[dict]:
    """`specs` compiled for `chip` in a fresh subprocess with libtpu's offline variables (and no network where
    `unshare -n` works); returns `chip`'s rows of `records`."""
    with tempfile.TemporaryDirectory() as tmp:
        todo = Path(tmp) / "specs.json"
        todo.write_text(json.dumps(specs))
        argv = [sys.executable, "-m", "benchmarks.tpu_aot", "--worker", chip, "--specs", str(todo), "--records",
                str(records)]
        env = {**os.environ, **tpu.offline_env(chip)}
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.run(tpu.offline_command(argv), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"the {chip} compile worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    wanted = {json.dumps(s) for s in specs}
    return [r for r in read_records(records) if r["chip"] == chip and json.dumps(r["spec"]) in wanted]


# ---- the model table: the programs at a report point, and the largest prompt each policy fits ----

def model_specs(model: str, batch: int, prompt: int, programs=("prefill", "step", "loop")) -> list[list]:
    return [["model", model, policy, program, batch, prompt] for policy in POLICIES for program in programs]


def models_stage(records: Path, chips: list[str], quick: bool) -> dict:
    """The larger chip compiles every policy's prompt pass at two lengths per batch (the fit: memory does not depend
    on the chip's size), one decode step at batch 1 and 8, the decode loop and the question at batch 1; each other
    chip compiles the same decode programs, its predicted largest prompts (the compiler's check of the fit), and the
    8B model tensor parallel over its 2x2 topology. Resumes from `records`."""
    models = ("llama-1b",) if quick else tuple(SHAPES)
    fit_chip = max(chips, key=lambda c: tpu.CHIPS[c].hbm_bytes)
    fit_specs = [["model", m, p, "prefill", b, t] for m in models for p in POLICIES for b in FIT_POINTS
                 for t in FIT_POINTS[b]]
    # the reference attention's prompt pass at the longest fit point: flash-style tiles, or T x T scores?
    fit_specs += [["model", m, "full", "prefill-xla", 1, FIT_POINTS[1][-1]] for m in models]
    decode_specs = [s for m in models for b in FIT_POINTS
                    for s in model_specs(m, b, FIT_POINTS[b][0],
                                         ("step", "loop", "question") if b == 1 else ("step",))]
    # tensor parallel over the 2x2 topology (Mosaic kernels under shard_map): the 8B model, whose bf16 weights
    # alone exceed a v5e's 16 GiB
    tp_specs = [] if quick else [["model-tp", "llama-8b", p, prog, 1, FIT_POINTS[1][0]] for p in POLICIES
                                 for prog in ("prefill", "step")]
    rows = {fit_chip: run_chip(fit_chip, decode_specs + fit_specs, records)}
    for c in chips:
        if c == fit_chip:
            continue
        verify = []
        for m in models:
            for p in POLICIES:
                for b in FIT_POINTS:
                    pts = [r for r in rows[fit_chip] if r["spec"][:5] == ["model", m, p, "prefill", b]]
                    t = largest_prompt(pts, c)
                    if t:
                        verify.append(["model", m, p, "prefill", b, t])
        rows[c] = run_chip(c, tp_specs + verify + decode_specs, records)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tpu_aot", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--chips", default="v5e,v6e", help="comma-separated, of: " + ", ".join(tpu.CHIPS))
    p.add_argument("--only", default="kernels,models", help="kernels, models, or both (comma-separated)")
    p.add_argument("--quick", action="store_true", help="the test suite's smaller set of shapes")
    p.add_argument("--out", type=cli.out_dir, default=RESULTS, help="folder for tpu_aot_{chip}.{json,md} and the records")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--specs", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--records", type=Path, default=None, help=argparse.SUPPRESS)
    cli.add_compile_cache_flag(p, measures_compile=True)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, json.loads(a.specs.read_text()), a.records)
        return 0
    chips = [c for c in a.chips.split(",") if c]
    for chip in chips:
        if chip not in tpu.CHIPS:
            raise InvalidInput(f"--chips: {chip!r} is not one of {', '.join(tpu.CHIPS)}")
    if not chips:
        raise InvalidInput(f"--chips {a.chips!r} names no chip; give one or more of {', '.join(tpu.CHIPS)}")
    suites = [s for s in a.only.split(",") if s]
    if not suites:
        raise InvalidInput(f"--only {a.only!r} names nothing to compile; give kernels, models or both")
    for suite in suites:
        if suite not in ("kernels", "models"):
            raise InvalidInput(f"--only: {suite!r} is not one of kernels, models")
    reason = tpu.unavailable()
    if reason:
        raise InvalidInput(f"cannot compile for TPU here: {reason}")
    a.out.mkdir(parents=True, exist_ok=True)
    records = a.out / f"tpu_aot_records{'_quick' if a.quick else ''}.jsonl"
    if "kernels" in suites:
        for chip in chips:
            run_chip(chip, list(kernel_specs(a.quick)), records)
    if "models" in suites:
        models_stage(records, chips, a.quick)
    for chip in chips:
        print(write_tables(read_records(records), chip, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, compile_cache=False))  # its compile seconds are first compiles
