"""Training KVzap's surrogate (`kvjax.surrogate`) on kvjax's own KVzip+ scores, as kvpress's `kvzap/train.py` does
on its (arXiv:2601.07891, section 3):

    X, y = kvzap.collect(model, contexts, policy)    # per sampled token: each layer's attention input, log KVzip+
    linear = kvzap.fit_linear(X, y)                  # ridge regression per layer (kvpress: sklearn's Ridge, alpha 1)
    mlp, history = kvzap.fit_mlp(X, y, hidden=...)   # AdamW with optax (kvpress: skorch's AdamW, cosine, clip 1)
    kvzap.rank_correlation(mlp, X_heldout, y_heldout)

`collect` reads each context once whole (a KVzip+ policy's prompt pass), replays it (`kvjax.kvzip.scores`: KVzip+'s
score of every cached pair, one replay when the context fits one chunk) and reads each layer's attention input
from a plain forward (`kvjax.drive.probe`); the target is the log of the score, as kvpress's collector takes it.
Any model kvjax drives that gives its attention input (`hidden`) and its output projection can be trained for.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import drive, engine, kvzip
from kvjax.engine import compiled
from kvjax.errors import InvalidInput, NonFiniteError
from kvjax.policies.kvzip import KVzip
from kvjax.surrogate import Surrogate, apply

FLOOR = 1e-30  # a score of exactly 0 (none here: a softmax is positive) would have no log


def _attention_input(geom, q, k, pos, hidden):
    if hidden is None:
        raise InvalidInput("KVzap's surrogate reads each layer's attention input, and this model gives none: pass "
                           "hidden to kvjax.layer.attend")
    return hidden


@compiled()
def _hidden_fn(model, tokens):
    return drive.probe(model, tokens, _attention_input)


@compiled(static=("plan",))
def _prompt_fn(model, tokens, positions, *, plan):
    return engine.prefill(model, tokens, positions, plan=plan)[1]


def collect(model, contexts: np.ndarray, policy: KVzip, per_context: int | None = None, seed: int = 0,
            progress: Callable | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`(X [n, layers, D], y [n, layers, kv_heads])`, float32: for `per_context` tokens drawn at random from each row
    of `contexts` `[rows, t]` (None: every token), each layer's attention input and the log of the token's KVzip+
    score at each KV head under `policy` (a `KVzip` with `plus=True`). `progress(i)`: called after each row."""
    if not (isinstance(policy, KVzip) and policy.plus) or type(policy) is not KVzip:
        raise InvalidInput(f"kvzap.collect: the targets are KVzip+ scores; {policy.describe()} is not KVzip+")
    contexts = np.asarray(contexts, np.int32)
    rows, t = contexts.shape
    rng = np.random.RandomState(seed)
    plan = drive.plan(model, policy, t + 1, t)
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    xs, ys = [], []
    for i, ids in enumerate(contexts):
        tokens = jnp.asarray(ids[None])
        cache = _prompt_fn(model, tokens, positions, plan=plan)
        score = kvzip.scores(model, cache, plan, ids.tolist(), policy)  # [L, kvh, t]
        hidden = np.stack([np.asarray(h[0], np.float32) for h in _hidden_fn(model, tokens)], axis=1)  # [t, L, D]
        pick = np.sort(rng.permutation(t)[:per_context]) if per_context else np.arange(t)
        xs.append(hidden[pick])
        ys.append(np.log(np.maximum(score, FLOOR)).transpose(2, 0, 1)[pick])
        if progress is not None:
            progress(i)
    x, y = np.concatenate(xs), np.concatenate(ys)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise NonFiniteError("kvzap.collect: non-finite attention inputs or scores")
    return x, y


def fit_linear(x: np.ndarray, y: np.ndarray, alpha: float = 1.0) -> Surrogate:
    """Per layer, ridge regression of `y` on `x` with an unpenalised intercept (sklearn's `Ridge(alpha)` as kvpress
    fits it), solved exactly in float64."""
    layers = []
    for i in range(x.shape[1]):
        xi, yi = x[:, i].astype(np.float64), y[:, i].astype(np.float64)
        mx, my = xi.mean(0), yi.mean(0)
        xc, yc = xi - mx, yi - my
        w = np.linalg.solve(xc.T @ xc + alpha * np.eye(xc.shape[1]), xc.T @ yc)  # [D, kvh]
        layers.append({"w": w, "b": my - mx @ w})
    return Surrogate("linear", tuple(layers))


def _mlp_loss(params, x, y):
    pred = jax.vmap(lambda p, h: apply("mlp", p, h), in_axes=(0, 1), out_axes=1)(params, x)
    return jnp.mean((pred - y) ** 2)


def fit_mlp(x: np.ndarray, y: np.ndarray, hidden: int, *, epochs: int = 15, lr: float = 5e-3, batch: int = 512,
            valid_share: float = 0.05, seed: int = 0, progress: Callable | None = None) -> tuple[Surrogate, dict]:
    """A two-layer MLP per layer (`hidden` units), trained on mean squared error over every layer and KV head at
    once with AdamW (optax; weight decay 0.01, torch's default), the learning rate on a cosine from `lr` to 0 over
    `epochs`, gradients clipped to norm 1, `valid_share` of the rows held out for the validation loss: kvpress's
    recipe (skorch), but for the output bias, which starts at the mean target. `(surrogate, {"train": [loss per epoch], "valid": [...]})`. `progress(epoch, train, valid)`."""
    import optax

    n, layers, d = x.shape
    kvh = y.shape[2]
    rng = np.random.RandomState(seed)
    order = rng.permutation(n)
    n_valid = max(1, int(n * valid_share))
    valid, train = order[:n_valid], order[n_valid:]
    steps_per_epoch = max(1, math.ceil(len(train) / batch))
    key = jax.random.key(seed)
    k1, k2, k3, k4 = jax.random.split(key, 4)

    def uniform(k, shape, fan_in):  # torch.nn.Linear's initialisation
        bound = 1 / math.sqrt(fan_in)
        return jax.random.uniform(k, shape, jnp.float32, -bound, bound)

    # the output bias starts at each layer and head's mean target (log scores sit far from 0: the MLP then learns
    # the deviations from the first step, where torch's initialisation spends its first epochs on the offset)
    params = {"w1": uniform(k1, (layers, d, hidden), d), "b1": uniform(k2, (layers, hidden), d),
              "w2": uniform(k3, (layers, hidden, kvh), hidden),
              "b2": uniform(k4, (layers, kvh), hidden) + jnp.asarray(y[train].mean(0), jnp.float32)}
    schedule = optax.cosine_decay_schedule(lr, epochs * steps_per_epoch)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    state = opt.init(params)

    @jax.jit
    def update(params, state, xb, yb):
        loss, grads = jax.value_and_grad(_mlp_loss)(params, xb, yb)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    @jax.jit
    def evaluate(params, xb, yb):
        return _mlp_loss(params, xb, yb)

    xj, yj = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
    history = {"train": [], "valid": []}
    for epoch in range(epochs):
        perm = train[rng.permutation(len(train))]
        total = 0.0
        for s in range(steps_per_epoch):
            idx = perm[s * batch:(s + 1) * batch]
            params, state, loss = update(params, state, xj[idx], yj[idx])
            total += float(loss) * len(idx)
        history["train"].append(total / len(train))
        history["valid"].append(float(evaluate(params, xj[valid], yj[valid])))
        if not all(math.isfinite(v) for v in (history["train"][-1], history["valid"][-1])):
            raise NonFiniteError(f"kvzap.fit_mlp: a non-finite loss at epoch {epoch + 1}")
        if progress is not None:
            progress(epoch, history["train"][-1], history["valid"][-1])
    arrays = jax.tree.map(np.asarray, params)
    return Surrogate("mlp", tuple({n: arrays[n][i] for n in arrays} for i in range(layers))), history


def predict(surrogate: Surrogate, x: np.ndarray) -> np.ndarray:
    """`[n, layers, kv_heads]`: the surrogate's scores for `x` `[n, layers, D]`."""
    return np.stack([np.asarray(surrogate.scores(i, jnp.asarray(x[:, i]))) for i in range(surrogate.num_layers)], 1)


def _ranks(a: np.ndarray) -> np.ndarray:
    r = np.empty(len(a), np.float64)
    r[np.argsort(a, kind="stable")] = np.arange(len(a))
    return r


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of two 1-d samples (Pearson's of their ranks; ties ranked in order, which
    continuous scores almost never have)."""
    ra, rb = _ranks(np.ravel(a)), _ranks(np.ravel(b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    if len(ra) < 2:
        raise InvalidInput("spearman: fewer than two samples have no rank correlation")
    return float((ra @ rb) / math.sqrt((ra @ ra) * (rb @ rb)))


def rank_correlation(surrogate: Surrogate, x: np.ndarray, y: np.ndarray) -> dict:
    """How well the surrogate orders held-out pairs as KVzip+ does: Spearman's rho over all pairs at once (the
    order a threshold acts on: one threshold for every layer and head), the mean over layers and KV heads of each
    one's own rho, and the mean squared error."""
    pred = predict(surrogate, x)
    if not np.all(np.isfinite(pred)):  # a NaN would rank anywhere and print as a correlation
        raise NonFiniteError("kvzap.rank_correlation: the surrogate predicts non-finite scores")
    per = [spearman(pred[:, i, h], y[:, i, h]) for i in range(y.shape[1]) for h in range(y.shape[2])]
    return {"spearman_all_pairs": spearman(pred, y), "spearman_mean_per_head": float(np.mean(per)),
            "mse": float(np.mean((pred - y) ** 2)), "pairs": int(y.size)}


__all__ = ["collect", "fit_linear", "fit_mlp", "predict", "rank_correlation", "spearman"]
