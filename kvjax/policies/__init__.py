"""Cache policies: frozen dataclasses of pure functions (see `base.Policy`)."""

import math

from kvjax.errors import InvalidInput
from kvjax.policies.base import (
    AppendsWhileDecoding,
    ChunkRule,
    Context,
    KeepsEveryToken,
    LayerPolicy,
    Policy,
    PooledRule,
    PromptMasking,
    ReadsTokens,
    Rule,
    StepOnlyWrites,
)
from kvjax.policies.chunkkv import ChunkKV
from kvjax.policies.compose import (
    EVERY_LAYER,
    ByHead,
    ByLayer,
    HeadSplit,
    PerLayer,
    by_head,
    by_layer,
    on_windows,
)
from kvjax.policies.duo import DuoAttention, DuoAttentionOnce, duo_from_pattern, streaming_heads
from kvjax.policies.gate import GateEviction
from kvjax.policies.h2o import H2O
from kvjax.policies.mat import (
    AnchorCache,
    grid_search_anchors,
    mat,
    mat_with_anchor,
    mat_with_sink,
)
from kvjax.policies.kvzip import KVgrad, KVzip
from kvjax.policies.kvzap import KVzap
from kvjax.policies.critical import CriticalAdaKV, CriticalKV
from kvjax.policies.plan import Group, LayerPlan, Plan, resolve
from kvjax.policies.quantized import Quantized
from kvjax.policies.razor import CompensatedWindow, RazorAttention, razor_from_heads
from kvjax.policies.recompress import Recompress
from kvjax.policies.ring import FullCache, LocalWindow, StreamingLLM
from kvjax.policies.scored import (
    TOVA,
    AdaKV,
    ExpectedAttention,
    KeyDiff,
    KNorm,
    ObservedAttention,
    PromptStreamingLLM,
    PyramidKV,
    SlimKV,
    SnapKV,
)


def _mat_anchor_slots(budget, anchor_slots, ratio=None):
    # Default β = c/4: inside the range [32, 96] the paper found flat at c = 256 (Fig. 5). Under a ratio
    # each row has its own c, while β is one count: it must be chosen (the paper grid-searches it per budget).
    if anchor_slots is not None:
        return anchor_slots
    if ratio is not None:
        raise InvalidInput(f"MAT: ratio={ratio} sizes each row's c as a share of its prompt, but anchor_slots=None: beta is "
                           "a token count to choose (the paper grid-searches it per budget)")
    return max(1, budget // 4)


def _needs(value, policy: str, flag: str):
    if value is None:
        raise InvalidInput(f"--policy {policy} needs {flag}")
    return value


def default_shallow_layers(num_layers: int | None) -> int:
    """MAT's L_s: the paper's 2 of 32 layers scaled to `num_layers` (at least 1 and below the depth, 0 for a
    1-layer model); 2 when the depth is not known."""
    if num_layers is None:
        return 2
    return min(max(1, round(2 * num_layers / 32)), num_layers - 1)


def _sized(budget, ratio):
    # --ratio replaces the token budget (kvpress's compression_ratio): the policy is built with budget=None
    return None if ratio is not None else budget


# CLI name -> constructor. Keyword names are the command-line options (kvjax/experiments/common.py).
REGISTRY = {
    "full": lambda budget, positions="absolute", prefill_mode="full", chunk=None: FullCache(
        positions=positions, prefill_mode=prefill_mode, chunk=chunk
    ),
    # --ratio replaces the token budget here too: each row keeps floor(n * (1 - ratio)) of its n prompt tokens
    "local": lambda budget, ratio=None, positions="absolute", prefill_mode="full", chunk=None: LocalWindow(
        size=_sized(budget, ratio), ratio=ratio, positions=positions, prefill_mode=prefill_mode, chunk=chunk,
    ),
    "streaming": lambda budget, sinks=4, ratio=None, positions="absolute", prefill_mode="full", chunk=None:
    StreamingLLM(
        budget=_sized(budget, ratio), sinks=sinks, ratio=ratio, positions=positions, prefill_mode=prefill_mode,
        chunk=chunk,
    ),
    # --shallow-layers defaults to the paper's 2 of 32 layers scaled to the model's depth (at least 1, and
    # below the depth, so that some layer is deep: MAT with L_s = L would be StreamingLLM)
    "mat": lambda budget, anchor_slots=None, shallow_layers=None, sinks=4, group_agg="mean", ratio=None,
    positions="absolute", prefill_mode="stream", chunk=None, num_layers=None: mat(
        _sized(budget, ratio), _mat_anchor_slots(budget, anchor_slots, ratio),
        shallow_layers if shallow_layers is not None else default_shallow_layers(num_layers), sinks,
        group_agg=group_agg, ratio=ratio, positions=positions, prefill_mode=prefill_mode, chunk=chunk,
    ),
    "mat-sink": lambda budget, sinks=4, ratio=None, positions="absolute", prefill_mode="stream", chunk=None:
    mat_with_sink(_sized(budget, ratio), sinks, ratio=ratio, positions=positions, prefill_mode=prefill_mode,
                  chunk=chunk),
    "mat-anchor": lambda budget, anchor_slots=None, group_agg="mean", ratio=None, positions="absolute",
    prefill_mode="stream", chunk=None: mat_with_anchor(
        _sized(budget, ratio), _mat_anchor_slots(budget, anchor_slots, ratio), group_agg=group_agg, ratio=ratio,
        positions=positions, prefill_mode=prefill_mode, chunk=chunk,
    ),
}
"""`--policy` name -> constructor taking `budget` and the policy's command-line options (by their `dest`);
`make_policy(name, budget, **options)` builds from it and refuses an option the policy does not take."""


def _scored(cls, budget, ratio=None, **kw):
    return cls(budget=_sized(budget, ratio), ratio=ratio, **kw)


REGISTRY.update({
    "snapkv": lambda budget, ratio=None, observation_window=32, kernel=7, pool="max", group_agg="mean",
    positions="absolute", prefill_mode="full", chunk=None: _scored(
        SnapKV, budget, ratio, observation_window=observation_window, kernel=kernel, pool=pool, group_agg=group_agg,
        positions=positions, prefill_mode=prefill_mode, chunk=chunk),
    "pyramidkv": lambda budget, num_layers, ratio=None, observation_window=32, kernel=7, pool="max", group_agg="mean",
    beta=20, positions="absolute", prefill_mode="full", chunk=None: _scored(
        PyramidKV, budget, ratio, observation_window=observation_window, kernel=kernel, pool=pool, group_agg=group_agg,
        beta=beta, num_layers=num_layers, positions=positions, prefill_mode=prefill_mode, chunk=chunk),
    "slimkv": lambda budget, ratio=None, observation_window=32, kernel=7, pool="avg", combine="product",
    positions="absolute", prefill_mode="full", chunk=None: _scored(
        SlimKV, budget, ratio, observation_window=observation_window, kernel=kernel, pool=pool, combine=combine,
        positions=positions, prefill_mode=prefill_mode, chunk=chunk),
    "h2o-prefill": lambda budget, ratio=None, observation_window=0, group_agg="mean", positions="absolute",
    prefill_mode="full", chunk=None: _scored(
        ObservedAttention, budget, ratio, observation_window=observation_window, group_agg=group_agg,
        positions=positions, prefill_mode=prefill_mode, chunk=chunk),
    "tova": lambda budget, ratio=None, positions="absolute", prefill_mode="full", chunk=None: _scored(
        TOVA, budget, ratio, positions=positions, prefill_mode=prefill_mode, chunk=chunk),
    "knorm": lambda budget, ratio=None, observation_window=0, positions="absolute", prefill_mode="full", chunk=None:
        _scored(KNorm, budget, ratio, observation_window=observation_window, positions=positions,
                prefill_mode=prefill_mode, chunk=chunk),
    # AdaKV on SnapKV's score: one top-k over a layer's heads, each head at least --adakv-alpha of the count
    "adakv": lambda budget, ratio=None, observation_window=32, kernel=7, pool="max", group_agg="mean",
    adakv_alpha=0.2: AdaKV(scorer=_scored(SnapKV, budget, ratio, observation_window=observation_window, kernel=kernel,
                                          pool=pool, group_agg=group_agg), alpha=adakv_alpha),
    # ChunkKV on SnapKV's score: whole chunks of chunk_length (kvpress's 20) contiguous tokens, ranked by their mean
    # score summed over the KV heads
    "chunkkv": lambda budget, ratio=None, observation_window=32, kernel=7, pool="max", group_agg="mean",
    chunk_length=20: ChunkKV(scorer=_scored(SnapKV, budget, ratio, observation_window=observation_window, kernel=kernel,
                                            pool=pool, group_agg=group_agg), chunk_length=chunk_length),
    "expected-attention": lambda budget, ratio=None, observation_window=0, sinks=4, positions="absolute",
    prefill_mode="full", chunk=None: _scored(ExpectedAttention, budget, ratio, observation_window=observation_window,
                                             sinks=sinks, positions=positions, prefill_mode=prefill_mode, chunk=chunk),
    "keydiff": lambda budget, ratio=None, observation_window=0, positions="absolute", prefill_mode="full", chunk=None:
        _scored(KeyDiff, budget, ratio, observation_window=observation_window, positions=positions,
                prefill_mode=prefill_mode, chunk=chunk),
    # --ratio: each row keeps floor(n * (1 - ratio)) of its n prompt tokens; --recent defaults to half of
    # --budget, or under --ratio to half of each row's budget
    "h2o": lambda budget, recent=None, ratio=None, positions="absolute", prefill_mode="full", chunk=None: H2O(
        budget=_sized(budget, ratio), ratio=ratio, recent=recent, positions=positions, prefill_mode=prefill_mode,
        chunk=chunk),
    # Attention-Gate: the trained gates decide (load them with --gate-params); no budget.
    "gate": lambda budget, bucket=64: GateEviction(bucket=bucket),
    # RazorAttention takes no token budget: --compression C and --buffer S0 set the local heads' window
    # (default 5 and 4000), or --ratio the share of each prompt a local head keeps.
    "razor": lambda budget, heads=None, compression=None, buffer=None, ratio=None, sinks=None, compensate=None,
    fold="decode", prefill_mode="full", chunk=None: razor_from_heads(
        heads, compression=compression, buffer=buffer, ratio=ratio, sinks=sinks, compensate=compensate, fold=fold,
        prefill_mode=prefill_mode, chunk=chunk),
    # DuoAttention: a pattern (DuoAttention's attn_patterns folder, or a heads file with duo_scores from
    # `kvjax.experiments.find_heads --duo`); --head-compression: the share of KV heads made streaming heads
    "duo": lambda budget, duo_pattern=None, head_compression=0.5, sinks=None, recent=None, prefill_mode="full",
    chunk=None: duo_from_pattern(_needs(duo_pattern, "duo", "--duo-pattern"), head_compression, sinks=sinks,
                                 recent=recent, prefill_mode=prefill_mode, chunk=chunk),
    # StreamingLLM as kvpress's StreamingLLMPress runs it: sinks and window chosen once from the prompt, then every
    # new token appended (`streaming` slides its window through the question and the answer, as the paper does)
    "streaming-kvpress": lambda budget, ratio=None, sinks=4: _scored(PromptStreamingLLM, budget, ratio, sinks=sinks),
    # DuoAttention as kvpress's DuoAttentionPress runs it: the streaming heads' sinks and window chosen once from
    # the prompt, then every new token appended (`duo` slides them, as the paper does)
    "duo-kvpress": lambda budget, duo_pattern=None, head_compression=0.5, sinks=None, recent=None: duo_from_pattern(
        _needs(duo_pattern, "duo-kvpress", "--duo-pattern"), head_compression, sinks=sinks, recent=recent,
        kind=DuoAttentionOnce),
    # RazorAttention Table 1's protocol: the heads of the table kept whole, every other head "only the recent
    # 4K tokens" (--buffer S0, default 4000): no sinks, no compensation token, no N / C.
    "razor-table1": lambda budget, heads=None, buffer=None, prefill_mode="full", chunk=None: razor_from_heads(
        heads, compression=math.inf, buffer=buffer if buffer is not None else 4000, sinks=0, compensate=False,
        prefill_mode=prefill_mode, chunk=chunk),
    # KVzip: --ratio of all layers' slots evicted together; its replay prompts are the model's tokenizer's ids
    # (`replay`, given by the suites from the model's tokenizer: kvjax.kvzip.replay_prompts)
    "kvzip": lambda budget, ratio=None, sinks=None, kvzip_chunk=None, kvzip_layerwise=None, replay=None: _kvzip(
        ratio, sinks, kvzip_chunk, kvzip_layerwise, replay),
    # KVzip+: KVzip's replay scores divided by each replay query's input norm and multiplied by the pair's ‖v W_o‖_2
    "kvzip-plus": lambda budget, ratio=None, sinks=None, kvzip_chunk=None, kvzip_layerwise=None, replay=None: _kvzip(
        ratio, sinks, kvzip_chunk, kvzip_layerwise, replay, plus=True),
    # KVgrad: KVzip's replay probabilities times ‖v W_o‖_2 times the norm of the gradient of the replay's last hidden
    # states' squared norm w.r.t. each query's attention output; --kvzip-chunk defaults to 512 (kvpress's KVgradPress)
    "kvgrad": lambda budget, ratio=None, sinks=None, kvzip_chunk=None, kvzip_layerwise=None, replay=None: _kvzip(
        ratio, sinks, kvzip_chunk, kvzip_layerwise, replay, kind=KVgrad),
    # CriticalKV / CriticalAdaKV on SnapKV's score (the Python API wraps any scorer): epsilon 1e-4 and a first stage
    # of half the count, kvpress's defaults
    "criticalkv": lambda budget, ratio=None, observation_window=32, kernel=7, pool="max", group_agg="mean",
    epsilon=1e-4, first_stage_ratio=0.5:
    CriticalKV(scorer=_scored(SnapKV, budget, ratio, observation_window=observation_window, kernel=kernel, pool=pool,
                              group_agg=group_agg), epsilon=epsilon, first_stage_ratio=first_stage_ratio),
    "critical-adakv": lambda budget, ratio=None, observation_window=32, kernel=7, pool="max", group_agg="mean",
    adakv_alpha=0.2, epsilon=1e-4, first_stage_ratio=0.5: CriticalAdaKV(
        scorer=_scored(SnapKV, budget, ratio, observation_window=observation_window, kernel=kernel, pool=pool,
                       group_agg=group_agg), alpha=adakv_alpha, epsilon=epsilon, first_stage_ratio=first_stage_ratio),
    # KVzap under DMS's threshold: a trained surrogate (--kvzap DIR, kvjax.surrogate) scores each pair; those below
    # --threshold are evicted once older than --dms-window tokens (128, kvpress's); --kvzap-decoding: while decoding too
    "kvzap": lambda budget, kvzap=None, threshold=None, dms_window=128, kvzap_decoding=False: _kvzap(
        kvzap, threshold, dms_window, kvzap_decoding),
})

# Policies sized by their own options rather than --budget.
NO_BUDGET = frozenset({"full", "razor", "razor-table1", "gate", "duo", "duo-kvpress", "kvzip", "kvzip-plus", "kvgrad", "kvzap"})


def _kvzap(path, threshold, window, decoding) -> KVzap:
    if path is None:
        raise InvalidInput("KVzap scores pairs with a trained surrogate: give its directory (--kvzap DIR, written by "
                           "python -m kvjax.experiments.train_kvzap)")
    if threshold is None:
        raise InvalidInput("KVzap evicts the pairs its surrogate scores below a threshold: give it (--threshold)")
    from kvjax.surrogate import Surrogate, load

    surrogate = path if isinstance(path, Surrogate) else load(path)[0]
    return KVzap(surrogate=surrogate, threshold=threshold, window=window, decoding=bool(decoding))


def _kvzip(ratio, sinks, chunk, layerwise, replay, plus=False, kind=KVzip) -> KVzip:
    if ratio is None:
        raise InvalidInput("KVzip evicts a share of all layers' slots together: give ratio (--ratio)")
    if replay is None:
        raise InvalidInput("KVzip's replay prompts are token ids of the model's tokenizer, and this model has none "
                           "(or give replay=kvjax.kvzip.replay_prompts(tokenizer))")
    kw = {k: v for k, v in dict(sinks=sinks, chunk_size=chunk, layerwise=layerwise).items() if v is not None}
    return kind(ratio=ratio, **replay, **kw, **({"plus": True} if plus else {}))


def reduces_to(policy: Policy) -> str | None:
    """What `policy`'s parameters reduce it to, when that is another method (PyramidKV below kvpress's
    pyramid = SnapKV), for the tables to say; None when it is itself."""
    return policy.same_as()


def make_policy(name: str, budget: int | None = None, **options) -> Policy:
    """Builds a registered policy by name; `budget` is the cache size in tokens per KV head.

    Options a policy does not take are an error, so a typo is not silently ignored.
    """
    import inspect

    if name not in REGISTRY:
        raise InvalidInput(f"unknown policy {name!r}; available: {sorted(REGISTRY)}")
    if name not in NO_BUDGET and budget is None and options.get("ratio") is None:
        raise InvalidInput(f"policy {name!r} needs a budget or a ratio")
    accepted = set(inspect.signature(REGISTRY[name]).parameters) - {"budget"}
    unknown = set(options) - accepted
    if unknown:
        raise InvalidInput(f"policy {name!r} does not take {sorted(unknown)}; it takes {sorted(accepted)}")
    return REGISTRY[name](budget, **options)


__all__ = [
    "AdaKV", "AnchorCache", "AppendsWhileDecoding", "ByHead", "ByLayer", "ChunkKV", "ChunkRule", "CompensatedWindow", "Context", "DuoAttention", "DuoAttentionOnce", "ExpectedAttention", "GateEviction", "HeadSplit", "PromptStreamingLLM", "KeepsEveryToken", "RazorAttention", "ReadsTokens", "by_head",
    "razor_from_heads", "EVERY_LAYER", "FullCache", "H2O", "KNorm", "KVgrad", "KVzip", "KeyDiff", "LayerPolicy", "LocalWindow",
    "ObservedAttention", "PerLayer", "Plan", "LayerPlan", "Group", "resolve", "Policy", "PooledRule", "PromptMasking", "PyramidKV", "Quantized", "REGISTRY", "Recompress", "Rule", "SlimKV", "SnapKV", "StepOnlyWrites", "StreamingLLM", "TOVA",
    "by_layer", "default_shallow_layers", "duo_from_pattern", "streaming_heads", "grid_search_anchors", "make_policy", "mat", "mat_with_anchor", "on_windows",
    "mat_with_sink", "reduces_to",
    "CriticalAdaKV", "CriticalKV", "KVzap",
]
