"""Shared training loop for the trainable methods (AnLLM, Attention-Gate): optax + orbax.

* AdamW (paper defaults beta1 0.9, beta2 0.95), linear warmup then a constant LR (continual
  pre-training) or a cosine decay to `min_lr_ratio * lr` (pre-training from scratch);
* gradient accumulation over `accum` micro-batches;
* `compute_dtype="bfloat16"`: forward/backward in bf16 over float32 master weights;
* `trainable`: regexes over parameter paths (`layers/0/self_attn/q_proj/kernel`); the
  rest is frozen (no gradient, no optimizer state);
* an orbax CheckpointManager holds the trainable parameters, the optimizer state,
  the step (which is the data position: batches are a pure function of the step)
  and the loss history, so a killed run resumes exactly where it stopped;
* a tqdm bar, and the loss curve as JSON + PNG.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from kvjax import locks
from kvjax.progress import bar as progress_bar


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int
    lr: float = 2e-5  # AnLLM's continual pre-training
    warmup: int = 20
    decay: str = "constant"  # or "cosine" (to min_lr_ratio * lr at the last step)
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.0
    clip_norm: float | None = 1.0
    accum: int = 1
    compute_dtype: str | None = None  # "bfloat16": mixed precision
    trainable: tuple[str, ...] = ()  # regexes over parameter paths; () trains everything
    save_every: int = 50
    keep: int = 2

    def __post_init__(self):
        if self.steps < 1 or self.accum < 1 or self.warmup < 0 or self.save_every < 1:
            raise ValueError(f"TrainConfig: steps={self.steps}, accum={self.accum} and save_every="
                             f"{self.save_every} must be >= 1 and warmup={self.warmup} >= 0")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig: lr={self.lr} must be > 0")
        if self.decay not in ("constant", "cosine"):
            raise ValueError(f"TrainConfig: decay={self.decay!r}; expected 'constant' or 'cosine'")
        if self.compute_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"TrainConfig: compute_dtype={self.compute_dtype!r}; expected None, float32 or bfloat16")


def schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup` steps, then constant or cosine-decayed."""
    if cfg.decay == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, max(1, cfg.steps - cfg.warmup), alpha=cfg.min_lr_ratio)
    else:
        after = optax.constant_schedule(cfg.lr)
    if cfg.warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, cfg.warmup), after], [cfg.warmup])


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    adam = optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    return adam if cfg.clip_norm is None else optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adam)


def next_token_loss(
    logits: Float[Array, "b t V"], tokens: Int[Array, "b t"], weights: Float[Array, "b t"] | None = None
) -> Float[Array, ""]:
    """Mean cross-entropy of token t+1 given logits at t, over `weights` (1 = counts) of the targets."""
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
    w = jnp.ones_like(nll) if weights is None else weights[:, 1:].astype(nll.dtype)
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def trainable_filter(patterns: tuple[str, ...]):
    """An nnx filter: Params whose '/'-joined path matches one of `patterns` (all if empty)."""
    regexes = [re.compile(p) for p in patterns]

    def keep(path, value):
        if not isinstance(value, nnx.Param):
            return False
        name = "/".join(map(str, path))
        return not regexes or any(r.search(name) for r in regexes)

    return keep


@dataclasses.dataclass
class TrainResult:
    model: nnx.Module
    history: list[dict]  # {"step", "loss", **aux} per step
    resumed_from: int  # 0 for a fresh run


def _cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def train(
    model: nnx.Module,
    batch_fn: Callable[[int], dict],
    loss_fn: Callable[[nnx.Module, dict], tuple[Array, dict]],
    cfg: TrainConfig,
    out_dir: str | Path,
    *,
    compute_model: Callable[[], nnx.Module] | None = None,
    progress: bool = True,
    identity: dict | None = None,
) -> TrainResult:
    """Trains `model` in place for `cfg.steps` optimizer steps, resuming from `out_dir/checkpoints`.

    `batch_fn(i)` returns micro-batch `i` (a pure function of `i`, so the step is the data
    position); `loss_fn(model, batch)` returns `(loss, aux_scalars)`. `compute_model` builds an
    abstract model of the compute dtype (needed for `compute_dtype="bfloat16"`; defaults to
    `type(model)(model.cfg, dtype=bf16, rngs=...)`).

    The run's identity is `cfg` and `identity` (what else shapes the result: the command's options, the
    starting weights), kept in `out_dir/train_identity.json`: a checkpoint is resumed only by a run of the
    same identity, and one of another is refused naming each difference (a rerun with another learning
    rate once resumed the old run's weights silently).
    """
    import orbax.checkpoint as ocp

    out_dir = Path(out_dir).absolute()
    graphdef, params, rest = nnx.split(model, trainable_filter(cfg.trainable), ...)
    if not jax.tree.leaves(params):
        raise ValueError(f"no parameter matches trainable={cfg.trainable}")
    compute_graph = graphdef
    if cfg.compute_dtype == "bfloat16":
        build = compute_model or (lambda: type(model)(model.cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
        compute_graph = nnx.split(nnx.eval_shape(build), trainable_filter(cfg.trainable), ...)[0]
    tx = optimizer(cfg)
    opt_state = tx.init(params)

    locks.hold(out_dir)  # two runs never train into one directory (its checkpoints would interleave)
    manager = ocp.CheckpointManager(
        out_dir / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True)
    )
    # A constant-rate run given more steps continues the same trajectory, so its step count is not part of
    # the identity (a killed or extended run resumes); a cosine schedule spans its steps, so it is.
    fields = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in ("save_every", "keep") and not (k == "steps" and cfg.decay == "constant")}
    claim_training(out_dir, {**{f"TrainConfig.{k}": v for k, v in fields.items()}, **(identity or {})},
                   resuming=manager.latest_step() is not None)
    start, history = 0, []
    if manager.latest_step() is not None:
        start = manager.latest_step()
        target = {"params": nnx.to_pure_dict(params), "opt": opt_state}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = manager.restore(start, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        nnx.replace_by_pure_dict(params, restored["state"]["params"])
        opt_state = restored["state"]["opt"]
        history = restored["meta"]["history"]

    def micro_loss(p, r, batch):
        if cfg.compute_dtype == "bfloat16":
            p, r = _cast(p, jnp.bfloat16), _cast(r, jnp.bfloat16)
        loss, aux = loss_fn(nnx.merge(compute_graph, p, r), batch)
        return loss.astype(jnp.float32), aux

    @jax.jit
    def grads_of(p, r, batch):
        (loss, aux), g = jax.value_and_grad(micro_loss, has_aux=True)(p, r, batch)
        return loss, aux, _cast(g, jnp.float32)

    @jax.jit
    def apply(p, opt_state, g):
        updates, opt_state = tx.update(g, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    bar = None
    if progress:
        bar = progress_bar(total=cfg.steps, initial=start, desc="train", unit="step")
    try:
        for step in range(start, cfg.steps):
            total, aux_sum, g_sum = 0.0, {}, None
            for m in range(cfg.accum):
                loss, aux, g = grads_of(params, rest, batch_fn(step * cfg.accum + m))
                g_sum = g if g_sum is None else jax.tree.map(jnp.add, g_sum, g)
                total += float(loss) / cfg.accum
                for k, v in aux.items():
                    aux_sum[k] = aux_sum.get(k, 0.0) + float(v) / cfg.accum
            params, opt_state = apply(params, opt_state, jax.tree.map(lambda x: x / cfg.accum, g_sum))
            history.append({"step": step + 1, "loss": total, **aux_sum})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{total:.4f}")
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                manager.save(step + 1, args=ocp.args.Composite(
                    state=ocp.args.StandardSave({"params": nnx.to_pure_dict(params), "opt": opt_state}),
                    meta=ocp.args.JsonSave({"history": history})))
    finally:
        manager.wait_until_finished()
        if bar is not None:
            bar.close()
    nnx.update(model, params)
    write_curve(history, out_dir)
    return TrainResult(model=model, history=history, resumed_from=start)


def claim_training(out_dir: Path, identity: dict, *, resuming: bool) -> None:
    """Writes (fresh run) or checks (resumed run) `out_dir/train_identity.json`; a resumed run of another
    identity is an `InvalidInput` naming each differing option with both values."""
    from kvjax.errors import InvalidInput

    path = out_dir / "train_identity.json"
    now = json.loads(json.dumps(identity, sort_keys=True, default=str))
    if resuming:
        if not path.is_file():
            raise InvalidInput(f"{out_dir} holds checkpoints of a run whose options were not recorded; delete "
                               f"{out_dir} or train into a new directory")
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise InvalidInput(f"{path} is unreadable ({err}); delete {out_dir} or train into a new directory") from None
        diff = sorted(k for k in old.keys() | now.keys() if old.get(k) != now.get(k))
        if diff:
            show = lambda d, k: repr(d[k]) if k in d else "(not recorded)"  # noqa: E731
            raise InvalidInput(f"{out_dir} holds a training run of other options ("
                               + "; ".join(f"{k}: {show(old, k)} -> {show(now, k)}" for k in diff)
                               + f"); resuming it would not be this run: delete {out_dir} or train into a new "
                               "directory")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def write_curve(history: list[dict], out_dir: str | Path) -> None:
    """`loss.json` and `loss.png` (every scalar of the history against the step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "loss.json").write_text(json.dumps(history, indent=1))
    if not history:
        return
    keys = [k for k in history[0] if k != "step"]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
    steps = np.array([h["step"] for h in history])
    for ax, k in zip(axes[0], keys):
        ax.plot(steps, [h[k] for h in history])
        ax.set(xlabel="step", title=k)
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=100)
    plt.close(fig)
