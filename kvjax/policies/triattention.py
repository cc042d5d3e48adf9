"""TriAttention (Mao et al. 2026, arXiv:2604.04921): keys scored by a trigonometric series around the pre-RoPE query
centres, evicted while decoding.

With RoPE's half layout, frequency f of a head-dim-d vector x is the complex number `x_f = x[f] + i x[f + d/2]`. For
each layer and query head, a calibration text gives the mean pre-RoPE query `qbar_f` (complex) and the mean of its
magnitude `E|q|_f` (`QueryCentres`, computed by `calibrate`; the reference's `scripts/calibrate.py`). A cached key `k`
at position p (unrotated `k_f`), scored when `n` tokens have been read, is worth, per query head
(the reference's `triattention/methods/pruning_utils.py`):

    S(k) = mean_{D in offsets} sum_f |qbar_f| |k_f| s^2 cos((n - p + D) w_f + arg(qbar_f conj(k_f)))
           + sum_f (E|q|_f - |qbar_f|) |k_f| s^2

with `w_f` the RoPE frequencies, `s` RoPE's attention scaling (1 unless YaRN-like), offsets the powers of two up to
`offsets` (65536: 17 of them). The keys are cached rotated, `k_rot_f = s e^{i p w_f} k_f`, so the phase
`(n - p) w_f + arg(qbar_f conj(k_f))` is `n w_f + arg(qbar_f conj(k_rot_f))` and no key is unrotated. Each query head's
scores are z-scored over the cache (population standard deviation, at least 1e-6), the KV group takes the max over
its query heads, and each KV head keeps its top `budget` (`per_layer_perhead_pruning` in the reference).

The schedule is the reference's slack trigger: the cache holds `budget + decode_slots` tokens (`divide_length`, 128)
and is compressed back to the budget when full (`Decoding(when="full")`), the prompt kept whole until then. The latest
`observation_window` tokens are always kept (the reference's vLLM runtime: `window_size`, 128; its HF path protects
the prompt instead).

Where kvjax differs from the reference, said here: its default HF path averages each KV head's scores over all layers
and applies one kept set to every layer; kvjax ranks each layer by its own scores (the reference's per-layer,
per-head mode), as a layer's rule sees only its layer. No tie-break noise: ties go to the earlier position.
"""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from kvjax import values
from kvjax.errors import InvalidInput
from kvjax.policies.base import observation_window_option
from kvjax.policies.decoding import DECODE_SLOTS, Decoding
from kvjax.policies.options import Option, class_builder, given, option, register
from kvjax.policies.scored import ScoredPolicy


@dataclasses.dataclass(frozen=True, eq=False)
class QueryCentres:
    """Per layer and query head, the mean pre-RoPE query `qbar` (complex, `[layers, heads, d/2]` as real and imaginary
    parts) and the mean of each frequency's magnitude `abs_mean`; per layer, RoPE's frequencies `omega` `[layers, d/2]`
    and attention scaling `scale` `[layers]`. Equal (and hashed) by `digest`, the hash of its arrays: the identity a
    compiled program and a run's records are keyed by."""

    mean_re: np.ndarray
    mean_im: np.ndarray
    abs_mean: np.ndarray
    omega: np.ndarray
    scale: np.ndarray

    def __post_init__(self):
        layers, heads, half = np.shape(self.mean_re)
        shapes = {"mean_re": (layers, heads, half), "mean_im": (layers, heads, half), "abs_mean": (layers, heads, half),
                  "omega": (layers, half), "scale": (layers,)}
        for name, shape in shapes.items():
            if np.shape(getattr(self, name)) != shape:
                raise InvalidInput(f"QueryCentres: {name} has shape {np.shape(getattr(self, name))}; expected {shape}")
            if not np.all(np.isfinite(getattr(self, name))):
                raise InvalidInput(f"QueryCentres: {name} holds a non-finite number")
        h = hashlib.sha256(repr({n: s for n, s in shapes.items()}).encode())
        for name in shapes:
            h.update(np.ascontiguousarray(getattr(self, name), np.float32).tobytes())
        object.__setattr__(self, "digest", h.hexdigest()[:16])  # hashed on every compiled call: computed once

    def __eq__(self, other):
        return isinstance(other, QueryCentres) and other.digest == self.digest

    def __hash__(self):
        return hash(self.digest)

    def __repr__(self):
        return f"QueryCentres(sha256:{self.digest})"

    def save(self, path) -> None:
        """An `.npz` file (written whole, then renamed into place)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        tmp.replace(path)

    @classmethod
    def load(cls, path) -> QueryCentres:
        try:
            with np.load(path) as z:
                arrays = {f.name: np.asarray(z[f.name], np.float32) for f in dataclasses.fields(cls)}
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as err:
            raise InvalidInput(f"--centres {path}: not a TriAttention centres file ({err}); write one with python -m "
                               "kvjax.experiments.calibrate_triattention") from None
        try:
            return cls(**arrays)
        except InvalidInput as err:
            raise InvalidInput(f"--centres {path}: {err}") from None


def _unit_turns(rope, head_dim: int):
    """`[d/2, d]`: RoPE applied at position 1 to the unit vectors e_f (x_f = 1), f < d/2 (traceable)."""
    half = head_dim // 2
    eye = jnp.eye(head_dim, dtype=jnp.float32)[:half]
    return rope(eye[None], jnp.ones((1, half), jnp.int32))[0]


def _frequencies(turns) -> tuple[np.ndarray, float]:
    """`(omega [d/2], scale)` from `_unit_turns`; a rotation that is not the half layout is refused."""
    out = np.asarray(turns, np.float64)
    half = out.shape[0]
    f = np.arange(half)
    cos, sin = out[f, f], out[f, f + half]
    rest = out.copy()
    rest[f, f] = rest[f, f + half] = 0.0
    if np.abs(rest).max() > 1e-5:
        raise InvalidInput("TriAttention needs RoPE's half layout (rotate_half: frequency f pairs x[f] with "
                           "x[f + d/2]); this model rotates otherwise")
    return np.arctan2(sin, cos), float(np.hypot(cos, sin).mean())


def rope_frequencies(rope, head_dim: int) -> tuple[np.ndarray, float]:
    """`(omega [d/2], scale)` of a layer's RoPE, read from what it does to the unit vectors at position 1 (so any
    frequency scaling a model applies is the one measured)."""
    return _frequencies(_unit_turns(rope, head_dim))


def calibrate(model, tokens) -> QueryCentres:
    """The query centres of `model` over a calibration text (token ids, one row): each layer's pre-RoPE queries
    averaged over every position, as the reference's calibration pass (`scripts/calibrate.py`)."""
    from kvjax import drive

    half = model.cfg.head_dim // 2

    def read(geom, q, k, pos, hidden):
        if geom.rope is None:
            raise InvalidInput("TriAttention scores keys by RoPE's frequencies; this model has no rotary positions")
        z = q.astype(jnp.float32)[0]  # [h, t, d]
        z = z[..., :half] + 1j * z[..., half:]
        return jnp.real(z.mean(1)), jnp.imag(z.mean(1)), jnp.abs(z).mean(1), _unit_turns(geom.rope, 2 * half)

    rows = drive.probe(model, jnp.asarray([list(tokens)], jnp.int32), read)
    freqs = [_frequencies(r[3]) for r in rows]
    stack = lambda i: np.stack([np.asarray(r[i]) for r in rows]).astype(np.float32)  # noqa: E731
    return QueryCentres(mean_re=stack(0), mean_im=stack(1), abs_mean=stack(2),
                        omega=np.stack([f[0] for f in freqs]).astype(np.float32),
                        scale=np.asarray([f[1] for f in freqs], np.float32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TriAttention(ScoredPolicy):
    """TriAttention's score (the module docstring) from `centres`; `triattention(budget, centres)` runs it while
    decoding."""

    centres: QueryCentres | None = None
    observation_window: int = observation_window_option(128)
    offsets: int = option(65536, type=values.positive_int,
                          help="TriAttention: the largest future offset of the series (its powers of two up to this)")
    normalize: bool = True  # z-score each query head's scores before the group's max (the reference's experiments')
    chunk_refusal = "it scores a cache while decoding, not a prompt"

    def __post_init__(self):
        if self.prefill_mode == "chunked":
            raise InvalidInput(f"TriAttention cannot run prefill_mode='chunked': {self.chunk_refusal}")
        if self.positions != "absolute":
            raise InvalidInput("TriAttention: positions must be 'absolute': its phases are those of keys rotated at "
                               "their positions, as cached")
        super().__post_init__()
        if not isinstance(self.centres, QueryCentres):
            raise InvalidInput("TriAttention needs its query centres (centres=QueryCentres; on a command line "
                               "--centres FILE, written by python -m kvjax.experiments.calibrate_triattention)")

    def check(self, num_layers, num_kv_heads=None):
        layers, heads, _ = self.centres.mean_re.shape
        if layers != num_layers or (num_kv_heads is not None and heads % num_kv_heads):
            raise InvalidInput(f"TriAttention: the centres hold {layers} layers of {heads} query heads, the model "
                               f"{num_layers} layers of {num_kv_heads} KV heads: they were calibrated on another model")

    def layer_key(self, layer):
        return layer  # each layer reads its own centres: layers alike in shape are not alike here

    def series(self, layer: int, k, now):
        """`[b, kvh, g, C]`: each query head's score of each cached (rotated) key `k` `[b, kvh, C, d]`, `now` `[b]`
        tokens read."""
        c = self.centres
        b, kvh, _, d = k.shape
        half = d // 2
        if c.mean_re.shape[-1] != half or c.mean_re.shape[1] % kvh:
            raise InvalidInput(f"TriAttention: the centres are for head_dim {2 * c.mean_re.shape[-1]} and "
                               f"{c.mean_re.shape[1]} query heads, the model has {d} and {kvh} KV heads")
        g = c.mean_re.shape[1] // kvh
        qbar = (c.mean_re[layer] + 1j * c.mean_im[layer]).reshape(kvh, g, half)  # [kvh, g, F]
        extra = (c.abs_mean[layer] - np.abs(c.mean_re[layer] + 1j * c.mean_im[layer])).reshape(kvh, g, half)
        omega, s = jnp.asarray(c.omega[layer]), float(c.scale[layer])
        k = k.astype(jnp.float32)
        kc = k[..., :half] + 1j * k[..., half:]  # rotated: s e^{i p w} k_f
        shifts = 2.0 ** np.arange(int(np.log2(self.offsets)) + 1)  # 1, 2, 4, ... <= offsets
        # mean over the offsets of e^{i (n + D) w}: the phase of each future query position
        ahead = jnp.exp(1j * (now.astype(jnp.float32)[:, None, None] + shifts[None, :, None]) * omega).mean(1)
        rel = jnp.einsum("hgf,bhcf->bhgcf", qbar, jnp.conj(kc))  # qbar conj(k_rot) = s e^{-i p w} qbar conj(k)
        base = jnp.real(rel * ahead[:, None, None, None, :]).sum(-1) * s  # |qbar||k| s^2 cos(...), |k_rot| = s |k|
        norm = jnp.einsum("hgf,bhcf->bhgc", jnp.asarray(extra, jnp.float32), jnp.abs(kc)) * s
        return base + norm

    def score(self, layer, k, v, pos, stats):
        p = pos if pos.ndim == 3 else jnp.broadcast_to(pos[:, None, :], k.shape[:3])
        real = (p >= 0)[:, :, None]
        now = jnp.max(p, axis=(1, 2)) + 1  # tokens read: the reference's round_start
        s = self.series(layer, k, now)
        if self.normalize:
            n = jnp.maximum(jnp.sum(real, axis=-1, keepdims=True), 1)
            mean = jnp.sum(jnp.where(real, s, 0.0), axis=-1, keepdims=True) / n
            std = jnp.sqrt(jnp.sum(jnp.where(real, (s - mean) ** 2, 0.0), axis=-1, keepdims=True) / n)
            s = (s - mean) / jnp.maximum(std, 1e-6)
        return jnp.max(jnp.where(real, s, -jnp.inf), axis=2)


def triattention(budget, centres=None, observation_window=None, offsets=None, decode_slots=128) -> Decoding:
    """TriAttention as its reference decodes: the prompt kept whole, the cache compressed back to `budget` when it
    holds `budget + decode_slots` tokens. `centres`: a `QueryCentres`, or the path of its file."""
    if centres is not None and not isinstance(centres, QueryCentres):
        centres = QueryCentres.load(centres)
    scorer = class_builder(TriAttention)(budget, **given(centres=centres, observation_window=observation_window,
                                                         offsets=offsets))
    return Decoding(scorer=scorer, every=decode_slots, when="full")


CENTRES = Option(help="TriAttention: the query centres file (.npz) of the model, written by python -m "
                      "kvjax.experiments.calibrate_triattention")
register("triattention", build=triattention, classes=(TriAttention,),
         options={"centres": CENTRES, "decode_slots": DECODE_SLOTS}, paper="Mao et al. 2026 (TriAttention)",
         docs="policies/decoding.md#triattention", chunked="refused",
         memory="real (budget + decode_slots slots while decoding; a longer prompt until its first step)")

__all__ = ["QueryCentres", "TriAttention", "calibrate", "rope_frequencies", "triattention"]
