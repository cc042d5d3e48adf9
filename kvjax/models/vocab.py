"""AnLLM-AC's `<AC>` token added to a Llama and its tokenizer: the embedding grows, the new row initialised
as the paper's official code does (papers/anllm-anchor-based-llms.md). Model code, so it lives here, not in
kvjax (which never imports kvjax/models/)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.anllm_anchors import AC_TOKEN


def add_ac_token(model, tokenizer, init: str = "mean", period: str = "."):
    """Adds `<AC>` to the tokenizer and one row to the embedding (and untied head).

    `init="mean"`: the mean of the embedding matrix (the paper); `"period"`: a copy of the
    `period` token's embedding (the official code). Returns `(model, tokenizer, ac_id)`; the
    model is rebuilt with `vocab_size + 1` if the tokenizer grows past the embedding.
    """
    if init not in ("mean", "period"):
        raise ValueError(f"init={init!r}; expected 'mean' or 'period'")
    tokenizer.add_special_tokens({"additional_special_tokens": [AC_TOKEN]})
    ac_id = tokenizer.convert_tokens_to_ids(AC_TOKEN)
    emb = np.asarray(model.embed_tokens.embedding[...])
    if init == "mean":
        row = emb.mean(axis=0)
    else:
        ids = tokenizer(period, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"{period!r} is {len(ids)} tokens for this tokenizer; 'period' init needs one")
        row = emb[ids[0]]
    if ac_id < emb.shape[0]:  # the vocabulary already had room (padded embedding)
        model.embed_tokens.embedding[...] = jnp.asarray(emb).at[ac_id].set(jnp.asarray(row, emb.dtype))
        return model, tokenizer, ac_id
    return resize_vocab(model, ac_id + 1, {ac_id: row}), tokenizer, ac_id


def resize_vocab(model, vocab_size: int, rows: dict[int, np.ndarray]):
    """A copy of `model` with `vocab_size` embedding rows (new rows from `rows`, else zeros); an
    untied lm_head grows the same way (new rows zero, so new tokens start with logit 0)."""
    import dataclasses

    from flax import nnx

    from kvjax.models.llama import Llama

    cfg = dataclasses.replace(model.cfg, vocab_size=vocab_size)
    new = Llama(cfg, dtype=model.dtype, rngs=nnx.Rngs(0))
    old_state = nnx.state(model)
    new_state = nnx.state(new)

    def grow(path, old, fresh):
        old = np.asarray(old)
        fresh = np.asarray(fresh)
        if old.shape == fresh.shape:
            return old
        out = np.zeros(fresh.shape, old.dtype)
        if path[0] == "embed_tokens":
            out[: old.shape[0]] = old
            for i, r in rows.items():
                out[i] = r
        else:  # lm_head kernel [D, V]
            out[:, : old.shape[1]] = old
        return out

    flat_old = dict(nnx.to_flat_state(old_state))
    flat_new = dict(nnx.to_flat_state(new_state))
    for path, var in flat_new.items():
        var.set_value(jnp.asarray(grow(path, flat_old[path].get_value(), var.get_value())))
    nnx.update(new, nnx.from_flat_state(flat_new))
    return new
