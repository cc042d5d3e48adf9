"""A researcher's own model for the contract tests: a small pure-pytree decoder (nothing from kvjax.models) whose
attention calls `kvjax.layer.attend`, and the ways a forward can break the contract, each a subclass that changes
one thing (`tests/test_reliability_contract.py`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import layer


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 61
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    max_position_embeddings: int = 256
    eos_token_ids: tuple = (2,)
    pad_token_id: int = 0
    windows: int | None = None


def rope(x, positions):
    d = x.shape[-1]
    ang = positions[..., None].astype(jnp.float32) / 10000 ** (jnp.arange(0, d, 2) / d)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x1 * jnp.sin(ang) + x2 * jnp.cos(ang)], -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Own:
    """The contract kept: `(logits of step.select(hidden), one carry entry per layer in layer order)`."""

    params: dict
    cfg: Config = dataclasses.field(metadata=dict(static=True))
    dtype = jnp.float32

    def __call__(self, tokens, positions, carry, step):
        c, p = self.cfg, self.params
        x, new = p["embed"][tokens], []
        b, t, _ = x.shape
        heads = lambda y, n: y.reshape(b, t, n, c.head_dim).transpose(0, 2, 1, 3)  # noqa: E731
        for i, (w, entry) in enumerate(zip(p["layers"], carry)):
            q, k, v = heads(x @ w["q"], c.num_heads), heads(x @ w["k"], c.num_kv_heads), heads(x @ w["v"],
                                                                                              c.num_kv_heads)
            geom = layer.Geometry(layer=i, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                  scale=c.head_dim ** -0.5, rope=rope)
            o, entry = layer.attend(geom, step, entry, q, k, v, positions, tokens)
            x = x + jnp.tanh(o.transpose(0, 2, 1, 3).reshape(b, t, -1) @ w["o"])
            new.append(entry)
        return self.finish(self.pick(step, x) @ p["head"], tuple(new))

    def pick(self, step, x):
        return step.select(x)

    def finish(self, logits, carry):
        return logits, carry


def init(cls=Own, cfg: Config = Config(), seed: int = 0, scale: float = 1.0):
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    d, h, kvh, hd = 32, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    n = lambda *s: 0.3 * scale * jax.random.normal(next(keys), s)  # noqa: E731
    layers = [dict(q=n(d, h * hd), k=n(d, kvh * hd), v=n(d, kvh * hd), o=n(h * hd, d)) for _ in range(cfg.num_layers)]
    return cls({"embed": n(cfg.vocab_size, d), "head": n(d, cfg.vocab_size), "layers": layers}, cfg)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Negated(Own):
    """A variant that computes something else from the same arrays (a subclass, same pytree structure)."""

    def finish(self, logits, carry):
        return -logits, carry


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Twin:
    """Another class with the same fields as `Own`: jax's treedefs of the two compare equal."""

    params: dict
    cfg: Config = dataclasses.field(metadata=dict(static=True))
    dtype = jnp.float32

    def __call__(self, tokens, positions, carry, step):
        logits, carry = Own(self.params, self.cfg)(tokens, positions, carry, step)
        return 2 * logits, carry


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Swapped(Own):
    """Hands its layers' carry entries back in reverse order."""

    def finish(self, logits, carry):
        return logits, carry[::-1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Short(Own):
    """Returns one carry entry too few."""

    def finish(self, logits, carry):
        return logits, carry[:-1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EveryPosition(Own):
    """Never calls `step.select`: logits for every position where the last was asked."""

    def pick(self, step, x):
        return x


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Reversed(Own):
    """Returns `(carry, logits)`."""

    def finish(self, logits, carry):
        return carry, logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Narrow(Own):
    """Logits narrower than `cfg.vocab_size`."""

    def finish(self, logits, carry):
        return logits[..., :-5], carry


class Opaque:
    """A model that is not a pytree: jax cannot see its arrays."""

    def __init__(self, model: Own):
        self.params, self.cfg, self.dtype = model.params, model.cfg, model.dtype

    def __call__(self, tokens, positions, carry, step):
        return Own(self.params, self.cfg)(tokens, positions, carry, step)
