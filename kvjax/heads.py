"""Which heads are retrieval heads: RazorAttention's probe (RoPE) and Theorem 1's vision scope (ALiBi).

RoPE models (paper §3.3): feed BOS + K random tokens repeated 4 times and measure,
for every layer and head,

* the echo score: attention from a token to the earlier copies of itself;
* the induction score: attention from a token to the tokens that followed its
  earlier copies (what an induction head predicts next).

Retrieval heads are the top 14 % by induction score plus the top 1 % by echo
score; a GQA KV head is a retrieval head if any of its query heads is.

ALiBi models (§3.1, Theorem 1): head `h` gives attention below `eps` to every key
farther than `L_h = (2 ||W_Q W_K||_2 (||g||^2 + ||b||^2) - log eps) / l_h`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax import drive, reference
from kvjax.masks import Mask

# Score elements per query block: bounds the `[heads, block, T]` buffer of the probe.
_BLOCK_ELEMENTS = 1 << 24


def probe_tokens(
    vocab_size: int, k: int = 2500, repeats: int = 4, bos_id: int | None = 1, seed: int = 0, exclude=()
) -> np.ndarray:
    """BOS followed by `k` random token ids repeated `repeats` times (the paper's probe).

    The `k` ids are distinct when the vocabulary allows it (without special ids
    in `exclude`), so "earlier copy of the current token" means exactly the
    same offset in an earlier repetition.
    """
    if k < 1 or repeats < 2:
        raise ValueError(f"probe: k={k} must be >= 1 and repeats={repeats} >= 2")
    pool = np.setdiff1d(np.arange(vocab_size), np.asarray([*exclude, *([] if bos_id is None else [bos_id])]))
    rng = np.random.default_rng(seed)
    ids = rng.choice(pool, size=k, replace=k > len(pool))
    seq = np.tile(ids, repeats)
    return np.concatenate([[bos_id], seq]).astype(np.int32) if bos_id is not None else seq.astype(np.int32)


def _rotated(geom, q, k, pos):
    """A layer's queries and keys rotated at their positions, as its attention reads them."""
    return geom.rotate(q, pos[:, None, :]), geom.rotate(k, pos[:, None, :])


def duo_scores(model, rows, q_len: int = 500) -> np.ndarray:
    """DuoAttention head scores "on the fly", as kvpress computes them (`duo_attention_on_the_fly`): per text
    (token ids) and layer, the mean unrotated query and key of each head over the text, each repeated `q_len`
    times and rotated by RoPE at positions 0..q_len-1; the last query's attention over those keys
    (`softmax(q k / sqrt(d))`); the score is the area under its cumulated curve (the mean of its cumulative
    sum), averaged over a KV head's query heads and over the texts. `[layers, kv_heads]`, higher for a head
    that spreads its attention over the context (a retrieval head). kvpress draws 50 BookSum chapters from
    the hub; here the caller gives the texts (offline)."""
    c = model.cfg
    total = np.zeros((c.num_layers, c.num_kv_heads))
    p = jnp.arange(q_len, dtype=jnp.int32)[None, None, :]

    def read(geom, q, k, pos, hidden):
        if geom.rope is None:
            raise ValueError("duo_scores needs a RoPE model (the repeated mean query and key are rotated)")
        h, kvh, d = geom.num_heads, geom.num_kv_heads, geom.head_dim
        qm = jnp.broadcast_to(q.mean(axis=2, keepdims=True), (1, h, q_len, d))
        km = jnp.broadcast_to(k.mean(axis=2, keepdims=True), (1, kvh, q_len, d))
        qr, kr = geom.rotate(qm, p), jnp.repeat(geom.rotate(km, p), h // kvh, axis=1)
        w = jax.nn.softmax(jnp.einsum("bhd,bhsd->bhs", qr[:, :, -1], kr).astype(jnp.float32) / d**0.5, axis=-1)
        return jnp.cumsum(w, axis=-1).mean(-1)[0].reshape(kvh, h // kvh).mean(-1)  # [kvh]

    for ids in rows:
        scores = drive.probe(model, jnp.asarray([list(ids)], jnp.int32), read)
        total += np.stack([np.asarray(x) for x in scores]) / len(rows)
    return total


def _logits(q, k, q_pos, k_pos, scale, mask: Mask):
    """Scaled, soft-capped, biased attention logits `[b, kvh, g, tq, tk]` of query block `q`
    `[b, h, tq, d]` (masked entries MASKED), as the layer's attention computes them (float32 for half-precision inputs)."""
    return reference.logits(q, k, q_pos, k_pos, scale=scale, mask=mask)


def _probs(q, k, q_pos, k_pos, scale, mask: Mask):
    """Attention probabilities `[b, kvh, g, tq, tk]` of query block `q` `[b, h, tq, d]`."""
    return jax.nn.softmax(_logits(q, k, q_pos, k_pos, scale, mask), axis=-1)


def attention_maps(model, tokens: Int[Array, "b t"], *, logits: bool = False) -> list[Float[np.ndarray, "b h t t"]]:
    """Every layer's dense attention probabilities, or with `logits=True` the pre-softmax logits
    `q.k / sqrt(d)` (+ ALiBi bias; -inf where masked), as MAT's Figure 1 / Table 1 read them.
    For short inputs: inspection, plots, tests."""
    tokens = jnp.asarray(tokens)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    def read(geom, q, k, pos, hidden):
        return (_logits if logits else _probs)(*_rotated(geom, q, k, pos), pos, pos, geom.scale, geom.mask())

    out = []
    for p in drive.probe(model, tokens, read):
        p = np.asarray(p.reshape(p.shape[0], -1, *p.shape[3:]))
        out.append(np.where(p <= reference._MASKED, -np.inf, p) if logits else p)  # masked: -inf, not a sentinel
    return out


@dataclasses.dataclass(frozen=True)
class HeadScores:
    """Per layer and query head: mean echo and induction attention over the probe's repeated tokens."""

    echo: np.ndarray  # [layers, heads]
    induction: np.ndarray  # [layers, heads]


@jax.jit
def _targets(tokens: Int[Array, "b t"]):
    """Echo and induction key masks' row counts: which queries have an earlier copy to attend to."""
    t = tokens.shape[1]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    prev = jnp.pad(tokens, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]  # token before each key
    echo = (tokens[:, None, :] == tokens[:, :, None]) & (j < i)
    ind = (prev[:, None, :] == tokens[:, :, None]) & (j < i) & (j >= 1)
    return jnp.any(echo, -1), jnp.any(ind, -1)


def _block_mass(q, k, tok_q, tok, q_pos, k_pos, scale, mask: Mask):
    """Echo and induction probability mass `[b, kvh, g, tq]` for one query block."""
    p = _probs(q, k, q_pos, k_pos, scale, mask)
    before = k_pos[:, None, :] < q_pos[:, :, None]  # [b, tq, tk]
    prev = jnp.pad(tok, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
    echo = (tok[:, None, :] == tok_q[:, :, None]) & before
    ind = (prev[:, None, :] == tok_q[:, :, None]) & before & (k_pos[:, None, :] >= 1)
    mass = lambda m: jnp.sum(jnp.where(m[:, None, None], p, 0.0), axis=-1)
    return mass(echo), mass(ind)


def head_scores(model, tokens: Int[Array, "b t"], progress: bool = False) -> HeadScores:
    """Echo and induction scores of every layer x query head on `tokens` (e.g. `probe_tokens`).

    A query's score is the attention mass on its echo (induction) keys; a head's
    score averages it over the queries that have such keys (the repeated copies).
    Runs query block by query block: never a `[T, T]` matrix for all heads.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim == 1:
        tokens = tokens[None]
    b, t = tokens.shape
    c = model.cfg
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    has_echo, has_ind = _targets(tokens)
    if not bool(jnp.any(has_echo)):
        raise ValueError("head_scores: no token repeats an earlier one, so echo/induction scores are undefined")
    block = max(1, min(t, _BLOCK_ELEMENTS // (b * c.num_heads * t)))
    n = -(-t // block)
    pad = lambda x, v: jnp.pad(x, ((0, 0), (0, n * block - t)), constant_values=v).reshape(b, n, block).transpose(1, 0, 2)
    tok_blocks, pos_blocks = pad(tokens, -2), pad(pos, -1)

    @functools.partial(jax.jit, static_argnames=("scale",))
    def layer_scores(q, k, mask, scale):
        qb = jnp.pad(q, ((0, 0), (0, 0), (0, n * block - t), (0, 0)))
        qb = qb.reshape(b, c.num_heads, n, block, -1).transpose(2, 0, 1, 3, 4)
        mass = jax.lax.map(
            lambda xs: _block_mass(xs[0], k, xs[1], tokens, xs[2], pos, scale, mask),
            (qb, tok_blocks, pos_blocks),
        )
        # [n, b, kvh, g, block] -> [b, h, t]
        unblock = lambda m: m.transpose(1, 2, 3, 0, 4).reshape(b, c.num_heads, n * block)[:, :, :t]
        echo, ind = unblock(mass[0]), unblock(mass[1])
        avg = lambda m, has: jnp.sum(jnp.where(has[:, None], m, 0), axis=(0, 2)) / jnp.maximum(jnp.sum(has), 1)
        return avg(echo, has_echo), avg(ind, has_ind)

    from tqdm import tqdm

    bar = tqdm(total=c.num_layers, desc="probe layers", unit="layer", disable=not progress)

    def read(geom, q, k, pos, hidden):  # run eagerly, layer by layer: each layer's scores as it is reached
        scores = layer_scores(*_rotated(geom, q, k, pos), geom.mask(), geom.scale)
        bar.update()
        return scores

    scores = drive.probe(model, tokens, read)
    bar.close()
    return HeadScores(echo=np.stack([np.asarray(e) for e, _ in scores]),
                      induction=np.stack([np.asarray(i) for _, i in scores]))


def _top(scores: np.ndarray, ratio: float) -> np.ndarray:
    """Mask of the top `ceil(ratio * n)` entries (ties: lower layer, then lower head)."""
    flat = scores.reshape(-1)
    n = math.ceil(ratio * flat.size - 1e-9)
    order = np.argsort(-flat, kind="stable")[:n]
    mask = np.zeros(flat.size, bool)
    mask[order] = True
    return mask.reshape(scores.shape)


def _check_ratio(name, value):
    if not 0 <= value <= 1:
        raise ValueError(f"{name}={value} must be in [0, 1]")


def select_retrieval(
    scores: HeadScores, num_kv_heads: int, induction_ratio: float = 0.14, echo_ratio: float = 0.01
) -> tuple[np.ndarray, np.ndarray]:
    """Retrieval heads: top `induction_ratio` by induction score ∪ top `echo_ratio` by echo score.

    Returns `(query_heads [layers, heads], kv_heads [layers, kv_heads])` bool masks;
    a KV head is a retrieval head if any query head of its group is. Counts round
    up, so a positive ratio picks at least one head.
    """
    _check_ratio("induction_ratio", induction_ratio)
    _check_ratio("echo_ratio", echo_ratio)
    q = _top(scores.induction, induction_ratio) | _top(scores.echo, echo_ratio)
    layers, heads = q.shape
    if heads % num_kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of num_kv_heads={num_kv_heads}")
    return q, q.reshape(layers, num_kv_heads, heads // num_kv_heads).any(-1)


def _spectral_norm(a: np.ndarray, b: np.ndarray) -> float:
    """`||a b^T||_2` for tall `a, b` `[D, d]`, from the `d x d` factors (no `D x D` matrix)."""
    _, ra = np.linalg.qr(a)
    _, rb = np.linalg.qr(b)
    return float(np.linalg.norm(ra @ rb.T, 2))


BOUNDS = ("paper", "sound")


def alibi_scopes(model, eps: float = 1e-3, bound: str = "paper") -> np.ndarray:
    """Theorem 1's vision scope `L_h` of every layer x query head of an ALiBi model, `[layers, heads]`.

    `bound="paper"` is eq. 2 as printed, with `||W_Q W_K||_2` taken over the
    scaled logit (the 1/sqrt(d) of attention folded into W_Q) and `b = 0`
    (RMSNorm). Its proof bounds `||x||^2` by `2 ||g||^2` and drops the diagonal
    term of the softmax denominator; `bound="sound"` redoes both: for RMSNorm
    input `||x||^2 < d max(g)^2`, and the weight is at most
    `exp(q_m.k_n - q_m.k_m - l_h (m - n)) <= exp(2 max|q.k| - l_h (m - n))`, so
    `L_h = (2 ||W_Q W_K^T|| d max(g)^2 - log eps) / l_h`. The two agree when g is
    constant; for uneven g only "sound" is a guarantee.
    """
    c = model.cfg
    if c.position_embedding != "alibi":
        raise ValueError(f"alibi_scopes: the model uses {c.position_embedding!r} positions, not ALiBi")
    if not 0 < eps < 1:
        raise ValueError(f"eps={eps} must be in (0, 1)")
    if bound not in BOUNDS:
        raise ValueError(f"bound={bound!r}; expected one of {BOUNDS}")
    if c.qkv_bias:
        raise NotImplementedError("alibi_scopes: Theorem 1 assumes q and k without bias")
    slopes = reference.alibi_slopes(c.num_heads).astype(np.float64)
    g = c.num_heads // c.num_kv_heads
    hd = c.head_dim
    out = np.zeros((c.num_layers, c.num_heads))
    for i, layer in enumerate(model.layers):
        gamma = np.asarray(layer.input_layernorm.weight[...], np.float64)
        wq = np.asarray(layer.self_attn.q_proj.kernel[...], np.float64) * hd**-0.5
        wk = np.asarray(layer.self_attn.k_proj.kernel[...], np.float64)
        for h in range(c.num_heads):
            norm = _spectral_norm(wq[:, h * hd : (h + 1) * hd], wk[:, (h // g) * hd : (h // g + 1) * hd])
            if bound == "paper":
                out[i, h] = (2 * norm * np.sum(gamma**2) - math.log(eps)) / slopes[h]
            else:
                out[i, h] = (2 * norm * gamma.size * np.max(gamma**2) - math.log(eps)) / slopes[h]
    return out


def kv_scopes(scopes: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """Per KV head, the widest scope among its query heads, rounded up to whole tokens."""
    layers, heads = scopes.shape
    return np.ceil(scopes.reshape(layers, num_kv_heads, heads // num_kv_heads).max(-1)).astype(np.int64)


# --- the heads file -------------------------------------------------------------------------

def control_heads(retrieval: np.ndarray, kind: str, seed: int = 0) -> np.ndarray:
    """RazorAttention's Table 1 controls for a `[layers, kv_heads]` retrieval table: "none" protects no
    head (every head local), "random" as many heads as `retrieval` does, drawn uniformly without
    replacement (deterministic in `seed`) from the heads the probe did *not* select, so that the
    control shares no head with the probe's table (a draw over all heads once included one)."""
    retrieval = np.asarray(retrieval, bool)
    if kind == "none":
        return np.zeros_like(retrieval)
    if kind != "random":
        raise ValueError(f"control={kind!r}; expected 'none' or 'random'")
    n = int(retrieval.sum())
    others = np.flatnonzero(~retrieval.ravel())
    if n > others.size:
        raise ValueError(f"control='random': the probe selected {n} of {retrieval.size} KV heads, more than the "
                         f"{others.size} it did not select; no random control disjoint from it exists")
    out = np.zeros(retrieval.size, bool)
    out[np.random.default_rng(seed).choice(others, n, replace=False)] = True
    return out.reshape(retrieval.shape)


def save_heads(path, **fields) -> None:
    """Writes a heads file: model shape, probe settings, scores and the retrieval heads (JSON)."""
    def plain(x):
        return x.tolist() if isinstance(x, np.ndarray) else x

    Path(path).write_text(json.dumps({k: plain(v) for k, v in fields.items()}, indent=1))


def load_heads(path) -> dict:
    """Reads a heads file written by `save_heads` / `python -m kvjax.experiments.find_heads`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"heads file {str(path)!r} does not exist (make one with python -m kvjax.experiments.find_heads)")
    data = json.loads(path.read_text())
    for key in ("num_layers", "num_kv_heads"):
        if key not in data:
            raise ValueError(f"heads file {str(path)!r} has no {key!r}")
    if "retrieval_kv_heads" not in data and "kv_scopes" not in data:
        raise ValueError(f"heads file {str(path)!r} has neither 'retrieval_kv_heads' (RoPE) nor 'kv_scopes' (ALiBi)")
    return data


def plot_heads(scores: HeadScores, retrieval: np.ndarray, path) -> None:
    """PNG heatmaps (layers x heads) of the echo and induction scores, retrieval heads outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * scores.echo.shape[0] + 2))
    for ax, name, m in zip(axes, ("echo", "induction"), (scores.echo, scores.induction)):
        im = ax.imshow(m, aspect="auto", cmap="viridis", vmin=0)
        ys, xs = np.nonzero(retrieval)
        ax.scatter(xs, ys, marker="s", facecolors="none", edgecolors="red", s=60, label="retrieval")
        ax.set(title=f"{name} score", xlabel="head", ylabel="layer")
        fig.colorbar(im, ax=ax)
    axes[1].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
