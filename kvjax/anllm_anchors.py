"""AnLLM's anchor tokens (papers/anllm-anchor-based-llms.md): the eq. 4 mask from token ids,
AnLLM-AC's `<AC>` token in a token stream (adding it to a model and tokenizer: `kvjax.models.vocab`), sentence splitting.

A sequence ends with its anchor: AnLLM-EP's anchors are existing ids (the English
period), AnLLM-AC's a new `<AC>` token appended after every sentence.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from kvjax.masks import AnchorMask

AC_TOKEN = "<AC>"


def anchor_flags(tokens: Int[Array, "b t"], anchor_ids) -> Bool[Array, "b t"]:
    """Which tokens are anchors (their id is in `anchor_ids`)."""
    return jnp.isin(jnp.asarray(tokens), jnp.asarray(list(anchor_ids), jnp.int32))


def anchor_mask(
    is_anchor: Bool[Array, "b t"], valid: Bool[Array, "b t"] | None = None, keep: Bool[Array, "b t"] | None = None
) -> AnchorMask:
    """Eq. 4's per-token arrays: a token's sequence index is the number of anchors before it
    (an anchor belongs to the sequence it ends). `valid` excludes padding; `keep` marks keys
    every later token may see (the "keep source" span)."""
    is_anchor = jnp.asarray(is_anchor, bool)
    if valid is not None:
        is_anchor = is_anchor & valid
    segment = jnp.cumsum(is_anchor, axis=-1, dtype=jnp.int32) - is_anchor.astype(jnp.int32)
    keep = jnp.zeros_like(is_anchor) if keep is None else jnp.asarray(keep, bool)
    return AnchorMask(segment=segment, anchor=is_anchor, keep=keep)


def dense_mask(mask: AnchorMask) -> Bool[Array, "b t t"]:
    """The full `[t, t]` eq. 4 mask including causality (for tests and plots; attention never builds it)."""
    t = mask.segment.shape[-1]
    return mask.visible() & jnp.tril(jnp.ones((t, t), bool))[None]


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)")


def split_sentences(text: str) -> list[str]:
    """Sentences ending in . ! or ? followed by whitespace (an NLTK-free splitter; trailing text
    without a final stop is a sentence too). Whitespace stays with the following sentence."""
    parts, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        parts.append(text[start : m.start()])
        start = m.start()
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def with_ac(text: str, ac: str = AC_TOKEN) -> str:
    """AnLLM-AC's training text: `<AC>` appended after every sentence."""
    return "".join(s + ac for s in split_sentences(text))


def parse_placement(placement: str) -> tuple[str, float | None]:
    """Where AnLLM-AC's `<AC>` goes: "sentence" (after every sentence, the paper's main setting), or
    Table 3's variants "every:N" (after every N tokens) and "random:p" (after each token with
    probability p)."""
    kind, _, arg = placement.partition(":")
    try:
        if kind == "sentence" and not arg:
            return kind, None
        if kind == "every" and int(arg) >= 1:
            return kind, int(arg)
        if kind == "random" and 0 < float(arg) < 1:
            return kind, float(arg)
    except ValueError:
        pass
    raise ValueError(f"placement={placement!r}; expected 'sentence', 'every:N' (N >= 1) or 'random:p' (0 < p < 1)")


def place_anchors(ids: list[int], ac_id: int, placement: str, seed: int = 0) -> list[int]:
    """`ids` with `ac_id` inserted at Table 3's token-level positions (`parse_placement`)."""
    kind, arg = parse_placement(placement)
    if kind == "sentence":
        raise ValueError("placement 'sentence' works on text: use with_ac(text)")
    rng = np.random.default_rng(seed)
    out = []
    for i, t in enumerate(ids):
        out.append(t)
        if (kind == "every" and (i + 1) % arg == 0) or (kind == "random" and rng.random() < arg):
            out.append(ac_id)
    return out
