"""Tile sizes of the Pallas kernels: frozen, validated once per call against the variant's rules.

* Triton (GPU): every tile dimension a power of two, and at least 16 (`tl.dot`'s smallest operand);
* Mosaic (TPU), compiled: the query tile a multiple of 8 (sublanes) and the key tile a multiple of
  128 (lanes), the (8, 128) tiling of a TPU vector register;
* interpret mode runs either variant's program on the CPU, where only positivity matters, so the
  tests can use small tiles (several per short test prompt) for both variants.
"""

from __future__ import annotations

import dataclasses

import numpy as np

VARIANTS = ("gpu", "tpu")


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """`block_q` queries by `block_k` keys per tile (prefill and colsum), or `block_k` cache slots per
    tile (decode, where the whole query group is one tile: `block_q` is unused there)."""

    block_q: int
    block_k: int

    def check(self, variant: str, interpret: bool) -> "BlockSizes":
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r}; expected one of {VARIANTS}")
        if self.block_q < 1 or self.block_k < 1:
            raise ValueError(f"{self}: tile sizes must be >= 1")
        if interpret:
            return self
        if variant == "gpu" and not all(_power_of_two(b) and b >= 16 for b in (self.block_q, self.block_k)):
            raise ValueError(f"{self}: Triton tiles must be powers of two >= 16")
        if variant == "tpu" and (self.block_q % 8 or self.block_k % 128):
            raise ValueError(f"{self}: Mosaic TPU tiles must be multiples of (8, 128) (block_q, block_k)")
        return self


PREFILL = {"gpu": BlockSizes(64, 64), "tpu": BlockSizes(128, 128)}
# GPU decode: 128 slots per tile, with 4 warps, 2 stages and 32 splits at batch 1 (kvjax.pallas.decode), was the
# fastest of 12 (tile, splits) and 6 (warps, stages) settings at 32K slots, batch 1 and 8, on an H200
# (benchmarks/results/decode_tuning_gpu_h200.md).
DECODE = {"gpu": BlockSizes(16, 128), "tpu": BlockSizes(8, 512)}


def resolve(defaults: dict[str, BlockSizes], variant: str, interpret: bool, block_q=None, block_k=None) -> BlockSizes:
    """The variant's default tiles with the caller's overrides, validated."""
    if variant not in defaults:
        raise ValueError(f"variant={variant!r}; expected one of {sorted(defaults)}")
    base = defaults[variant]
    return BlockSizes(block_q or base.block_q, block_k or base.block_k).check(variant, interpret)


def check_shapes(name: str, **arrays) -> None:
    """Raises ValueError quoting every shape unless each named axis letter has one size across the
    arrays: `check_shapes("f", q=(q, "bhtd"), k=(k, "bksd"))`."""
    sizes: dict[str, int] = {}
    bad = []
    for arg, (x, axes) in arrays.items():
        shape = np.shape(x)
        if len(shape) != len(axes):
            bad.append(f"{arg} has {len(shape)} axes, expected {len(axes)} ({' '.join(axes)})")
            continue
        for a, n in zip(axes, shape):
            if sizes.setdefault(a, n) != n:
                bad.append(f"axis {a} of {arg} is {n}, elsewhere {sizes[a]}")
    if bad:
        quoted = ", ".join(f"{arg} {tuple(np.shape(x))} [{' '.join(axes)}]" for arg, (x, axes) in arrays.items())
        raise ValueError(f"{name}: {'; '.join(bad)} -- shapes: {quoted}")
