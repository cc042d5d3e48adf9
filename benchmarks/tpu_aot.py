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

from kvjax import tpu
from kvjax.errors import InvalidInput

RESULTS = Path(__file__).parent / "results"
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Case:
    """One program to compile: `build(device)` returns `(fn, args, static)` with abstract args on `device`."""

    kernel: str
    shape: str
    build: Callable

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

    def build(dev):
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

    def build(dev):
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

    def build(dev):
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

    def build(dev):
        dt = DTYPES[dtype]
        spec = quant.KVQuant(bits, None if bits == 8 else 32, residual=128)
        qc = jax.eval_shape(lambda: quant.empty(spec, batch, KVH, slots, D, dt))
        qc = tpu.abstract(qc, tpu.on_device(dev))
        q, newest = _sds((batch, H, D), dt, dev), _sds((batch,), jnp.int32, dev)
        cur = (_sds((batch, KVH, D), dt, dev), _sds((batch, KVH, D), dt, dev))
        return (lambda q, qc, n, cur: quant_decode.attend(q, qc, n, cur, scale=D ** -0.5, probs=stats,
                                                          first_logit=stats, variant="tpu")), (q, qc, newest, cur), {}

    return Case("quant_decode", f"{dtype} {bits}-bit b{batch} C{slots}{' stats' if stats else ''}", build)


def kernel_cases(quick: bool = False) -> Iterator[Case]:
    """Every Mosaic kernel in both dtypes. `quick` (the test suite's): the smallest shape of each axis that
    changes the program, plus the long ones where only the grid grows."""
    for dtype in DTYPES:
        for slots in (4096, 32768, 131072):
            for batch in (1, 8):
                for stats in (False, True):
                    if quick and (slots, batch) not in ((4096, 1), (131072, 8)):
                        continue
                    yield decode_case(dtype, slots, batch, stats)
        for slots in (4096, 32768):
            for batch in (1, 8):
                if not quick or (slots, batch) == (4096, 1):
                    yield pool_case(dtype, slots, batch)
        for bits in (8, 4, 2):
            for slots, batch in ((4096, 1), (32768, 8)):
                for stats in (False, True):
                    if not quick or (slots, batch, stats) == (4096, 1, stats):
                        yield quant_case(dtype, bits, slots, batch, stats)
        for t in (2048, 8192, 32768):
            for mask in MASKS:
                if quick and t != 2048 and mask != "causal":
                    continue
                yield prefill_case(dtype, t, mask)
                if not (quick and t == 32768):  # colsum's compile grows with T (25 s at 32K on 2 cores)
                    yield prefill_case(dtype, t, mask, colsum=True)


# ---- running the cases for one chip, in this process (the worker) or in a subprocess (the driver) ----


def compile_case(case: Case, device) -> dict:
    row = {"kernel": case.kernel, "shape": case.shape}
    try:
        fn, args, static = case.build(device)
        with tpu.target([device]):
            compiled, seconds = tpu.compile(fn, *args, **static)
        row.update(ok=True, compile_s=round(seconds, 3), **tpu.analysis(compiled))
    except Exception as err:  # a kernel that does not compile is a result, reported with its first line
        row.update(ok=False, error=f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}",
                   detail=traceback.format_exc(limit=2)[-2000:])
    return row


def worker(chip: str, cases: list[Case]) -> list[dict]:
    device = tpu.topology(chip).devices[0]
    return [compile_case(case, device) | {"chip": chip} for case in cases]


def run_chip(chip: str, suite: str, quick: bool, timeout: float = 3600) -> list[dict]:
    """The cases of `suite` compiled for `chip` in a fresh subprocess with libtpu's offline variables."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        argv = [sys.executable, "-m", "benchmarks.tpu_aot", "--worker", chip, "--only", suite, "--json", str(out)]
        argv += ["--quick"] if quick else []
        env = {**os.environ, **tpu.offline_env(chip)}
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.run(tpu.offline_command(argv), env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"the {chip} compile worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def cases_of(suite: str, quick: bool) -> list[Case]:
    if suite == "kernels":
        return list(kernel_cases(quick))
    raise InvalidInput(f"--only {suite!r}: expected kernels")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tpu_aot", description=__doc__.split("\n\n")[0])
    p.add_argument("--chips", default="v5e,v6e", help="comma-separated, of: " + ", ".join(tpu.CHIPS))
    p.add_argument("--only", default="kernels", help="kernels")
    p.add_argument("--quick", action="store_true", help="the test suite's smaller set of shapes")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for tpu_aot_{chip}.{json,md}")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        a.json.write_text(json.dumps(worker(a.worker, cases_of(a.only, a.quick))))
        return 0
    chips = [c for c in a.chips.split(",") if c]
    for chip in chips:
        if chip not in tpu.CHIPS:
            raise InvalidInput(f"--chips: {chip!r} is not one of {', '.join(tpu.CHIPS)}")
    reason = tpu.unavailable()
    if reason:
        raise InvalidInput(f"cannot compile for TPU here: {reason}")
    for chip in chips:
        rows = run_chip(chip, a.only, a.quick)
        print(json.dumps(rows, indent=1)[:2000])
    return 0


if __name__ == "__main__":
    from kvjax import cli

    sys.exit(cli.run(main))
