"""KVzap (Jegou et al. 2026, arXiv:2601.07891) under DMS's threshold (kvpress 0.5.5's `DMSPress(KVzapPress(...))`).

A trained surrogate (`kvjax.surrogate.Surrogate`) scores each token's key-value pair per KV head from the layer's
attention input. A pair scored below `threshold` is evicted once it has left the sliding window of the `window`
most recent tokens; the window protects the tokens just written, whatever their score. So how much is evicted
depends on the text, not on a ratio: the records' `kv_held` says what a run held.

* prompt (dense prefill, DMS's "dense-prefill version"): the whole prompt attends as usual; then every pair
  older than the row's last `window` tokens is judged, and the kept pairs are written to the cache. The others
  keep their scores in the cache (`state["score"]`) for later.
* `decoding=True` (DMSPress's `decoding`): each decoded token (and each token of a question that extends the
  compressed context) is scored as it is written; after it has attended, the token `window` positions back is
  judged (kvpress's forward hook runs after the layer's attention: a token still sees the pair its step
  releases). `decoding=False`: decoding only appends, and the window left by the prompt is never judged.

Evicted slots are emptied, not freed (as KVzip's): the cache keeps a slot for every token of the sequence, and the
slots a prompt's evictions empty are refilled by decoded tokens. kvpress masks evicted keys in place; what
attention sees is the same.

Where kvjax differs from kvpress: a question that extends the compressed context (the question-agnostic
protocol) is read token by token here, so a question token no longer sees a pair that an earlier question token
released; kvpress reads the question in one forward and evicts after it. A chunked or streamed prefill is refused:
DMS's sparse prefill is another method.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.errors import InvalidInput
from kvjax.policies.delayed import DelayedEviction
from kvjax.policies.options import Option, given, register
from kvjax.stats import RuleStats, StatsRequest
from kvjax.surrogate import Surrogate


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVzap(DelayedEviction):
    """Evicts each pair the `surrogate` scores below `threshold` once it is older than the `window` most recent
    tokens (DMSPress's `sliding_window_size`, 128); `decoding`: also while decoding. See the module."""

    surrogate: Surrogate

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.surrogate, Surrogate):
            raise InvalidInput(f"KVzap: surrogate must be a kvjax.surrogate.Surrogate, not {type(self.surrogate)}")

    def check(self, num_layers, num_kv_heads=None):
        s = self.surrogate
        if s.num_layers != num_layers or (num_kv_heads is not None and s.kv_heads != num_kv_heads):
            raise InvalidInput(f"KVzap: the surrogate has {s.num_layers} layers of {s.kv_heads} KV heads; the model "
                               f"has {num_layers}" + ("" if num_kv_heads is None else f" of {num_kv_heads}"))

    def layer_key(self, layer):
        return layer  # each layer has its own surrogate weights

    def token_scores(self, layer, k, v, ctx):
        if ctx.hidden is None:
            raise InvalidInput(f"{self.describe()} scores each pair from the layer's attention input, and this model "
                               "gives none: pass hidden (the attention's input) to kvjax.layer.attend")
        if ctx.hidden.shape[-1] != self.surrogate.input_dim:
            raise InvalidInput(f"KVzap: the surrogate reads inputs of {self.surrogate.input_dim}; the model's "
                               f"attention input has {ctx.hidden.shape[-1]}")
        return jnp.moveaxis(self.surrogate.scores(layer, ctx.hidden), -1, 1)  # [b, kvh, (t)]

    def stats(self, layer):
        return RuleStats(prefill=StatsRequest(hidden=True))  # the surrogate scores the prompt's attention input

    def describe(self) -> str:
        return (f"KVzap(surrogate={self.surrogate!r}, threshold={self.threshold!r}, window={self.window}, "
                f"decoding={self.decoding})")


# ---- registration: KVzap under DMS's threshold, a trained surrogate (--kvzap DIR, kvjax.surrogate) scoring each pair


SURROGATE = Option(help="KVzap: its surrogate, a directory written by python -m kvjax.experiments.train_kvzap (kvjax "
                        "ships SmolLM2's and kvjax-small's under kvjax/models/kvzap/)")


def _kvzap(budget, kvzap=None, threshold=None, dms_window=None, dms_decoding=None) -> KVzap:
    if kvzap is None:
        raise InvalidInput("KVzap scores pairs with a trained surrogate: give its directory (--kvzap DIR, written by "
                           "python -m kvjax.experiments.train_kvzap)")
    if threshold is None:
        raise InvalidInput("KVzap evicts the pairs its surrogate scores below a threshold: give it (--threshold)")
    from kvjax.surrogate import load

    surrogate = kvzap if isinstance(kvzap, Surrogate) else load(kvzap)[0]
    return KVzap(surrogate=surrogate, threshold=threshold,
                 **given(window=dms_window, decoding=None if dms_decoding is None else bool(dms_decoding)))


register("kvzap", build=_kvzap, classes=(KVzap,), options={"kvzap": SURROGATE}, budget=False, paper="Jegou et al. 2026",
         docs="policies/kvzap.md", chunked="refused", kvpress="`DMSPress(KVzapPress)`",
         memory="**masked** (slots emptied, not freed)")


__all__ = ["KVzap"]
