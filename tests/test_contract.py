"""The one rule contract: every rule gets the same `Context` (positions and token ids), so a rule that
reads the ids composes per layer with no flag to forward; head groups resolve in one place."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kvcache
from kvjax.policies import Context, FullCache, GateEviction, LayerPolicy, Policy, StreamingLLM, by_head, by_layer
from kvjax import drive
from tests.conftest import prefill_policy


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeepEvenIds(LayerPolicy):
    """A rule that reads token ids (as AnLLM does): it keeps the prompt tokens whose id is even."""

    def capacity(self, layer, max_len, prompt_len=0):
        return max_len

    def prefill(self, layer, cache, k, v, ctx, stats):
        keep = (ctx.tokens % 2 == 0) & (ctx.pos >= 0)
        keep = jnp.broadcast_to(keep[:, None], k.shape[:3])
        return kvcache.gather_prompt(cache, k, v, ctx.pos, kvcache.compact(keep, cache.capacity))

    def step(self, layer, cache, k, v, ctx):
        return kvcache.append(cache, k, v, ctx.pos)


def test_no_rule_declares_what_it_reads():
    assert not [name for name in dir(Policy) if name.startswith("uses_")]


def test_a_rule_reading_token_ids_gets_them_inside_by_layer(tiny):
    """Layer 0 keeps the even ids (counted by hand from the prompt), layer 1 keeps everything, whether the
    rule is the policy or a member of `by_layer`; decoding then appends to both."""
    rng = np.random.default_rng(3)
    ids = rng.integers(4, tiny.model.cfg.vocab_size, 20)
    toks, pos = jnp.asarray(ids[None], jnp.int32), jnp.arange(20, dtype=jnp.int32)[None]
    even = [j for j in range(20) if ids[j] % 2 == 0]
    assert 0 < len(even) < 20
    for policy in (KeepEvenIds(), by_layer(KeepEvenIds(), FullCache(), split=1)):
        _, cache = prefill_policy(tiny.model, toks, pos, policy, 24)
        got = np.asarray(cache[0].pos[0])
        for h in range(tiny.model.cfg.num_kv_heads):
            assert got[h][got[h] >= 0].tolist() == even
        whole = np.asarray(cache[1].pos[0, 0])
        assert whole[whole >= 0].tolist() == (even if isinstance(policy, KeepEvenIds) else list(range(20)))
        _, cache = drive.decode(tiny.model, jnp.asarray([5], jnp.int32), jnp.asarray([20], jnp.int32), cache, drive.plan(tiny.model, policy))
        assert 20 in np.asarray(cache[0].pos[0, 0]).tolist() and 20 in np.asarray(cache[1].pos[0, 0]).tolist()


def test_a_gate_in_one_head_group_is_refused_with_the_reason(tiny):
    """The gate's flags mask the whole layer's prompt attention (eq. 7), so one head group cannot have
    them while its neighbours do not: the policy is refused by name, as AnLLM's eq. 4 is."""
    policy = by_head([[True, False]] * tiny.model.cfg.num_layers, GateEviction(), StreamingLLM(sinks=1, budget=8))
    with pytest.raises(ValueError, match="GateEviction.*cannot cache a head group of layer 0.*by_layer"):
        drive.empty_cache(tiny.model, drive.plan(tiny.model, policy, 64, 32), 1)


def test_the_context_is_a_pytree():
    """It crosses `jax.jit` and `lax.scan` as arrays: a new position or id is never a new program."""
    import jax

    ctx = Context(jnp.arange(3), jnp.asarray([7, 8, 9]))
    assert len(jax.tree.leaves(ctx)) == 2
    traces = []

    @jax.jit
    def f(c):
        traces.append(1)
        return c.pos + c.tokens

    f(ctx)
    f(Context(jnp.arange(3) + 5, jnp.asarray([1, 2, 3])))
    assert len(traces) == 1


# ---- the plan: a policy resolved once per model, what the model reads ----


def test_the_plan_resolves_each_layer_and_head_group():
    from kvjax.policies import Group, SnapKV, resolve

    stream, snap = StreamingLLM(budget=16, sinks=4), SnapKV(budget=16, observation_window=8)
    plan = resolve(by_layer(stream, snap, split=1), 3)
    assert [lp.groups for lp in plan.layers] == [(Group(None, stream),), (Group(None, snap),), (Group(None, snap),)]
    # a ring holds its budget; SnapKV its budget of the prompt plus the 100 - 40 tokens generated after it
    assert [lp.capacities(100, 40) for lp in plan.layers] == [(16,), (16 + 60,), (16 + 60,)]
    nested = by_layer(stream, by_head([[True, False], [False, True]], FullCache(), snap), split=1)
    plan = resolve(nested, 2, num_kv_heads=2)
    assert plan.layers[0].groups == (Group(None, stream),) and not plan.layers[0].split
    # layer 1 is the by_head's layer 1: KV head 1 selected (full), head 0 the rest (SnapKV)
    assert plan.layers[1].groups == (Group((1,), FullCache()), Group((0,), snap))
    assert plan.layers[1].capacities(100, 40) == (100, 16 + 60)
    assert plan.describe().splitlines()[1] == (f"layer 1: KV heads [1]: {FullCache().describe()}; "
                                               f"KV heads [0]: {snap.describe()}")
    assert plan.rules() == (stream, FullCache(), snap)


def test_a_head_split_nested_in_by_layer_caches_from_the_plan(tiny):
    """Layer 0 a StreamingLLM ring, layer 1 split: KV head 0 keeps the whole prompt, head 1 a ring; the
    kept positions and the arrays' sizes are the hand count for a 20-token prompt."""
    stream = StreamingLLM(budget=8, sinks=4)
    policy = by_layer(stream, by_head([[True, False]] * 2, FullCache(), stream), split=1)
    cache = drive.empty_cache(tiny.model, drive.plan(tiny.model, policy, 24, 20), 1)
    assert cache[0].capacity == 8
    assert cache[1].heads == ((0,), (1,)) and [g.capacity for g in cache[1].groups] == [24, 8]
    ids = np.random.default_rng(0).integers(4, tiny.model.cfg.vocab_size, 20)
    _, cache = prefill_policy(tiny.model, jnp.asarray(ids[None], jnp.int32), jnp.arange(20, dtype=jnp.int32)[None], policy, 24)
    ring = [0, 1, 2, 3, 16, 17, 18, 19]  # 4 sinks and the last 4
    kept = lambda c: sorted(p for p in np.asarray(c.pos[0, 0]).tolist() if p >= 0)  # noqa: E731
    assert kept(cache[0]) == ring
    assert kept(cache[1].groups[0]) == list(range(20)) and kept(cache[1].groups[1]) == ring


def test_combinators_answer_no_rule_question_and_the_plan_answers_for_them(tiny):
    """A combinator only says which rule caches what: it is no `Rule` and has none of a rule's members
    (capacity, position mode, prefill, step, statistics), inherited or stubbed; the plan's whole-model answers
    are those of its rules."""
    from kvjax.policies import Rule, SnapKV, resolve
    from kvjax.scoring import stream_logprobs

    stream, rolling = StreamingLLM(budget=16, sinks=4), StreamingLLM(budget=16, sinks=4, positions="rolling")
    layers, heads = by_layer(stream, SnapKV(budget=64), split=1), by_head([[True, False]] * 2, rolling, rolling)
    for combinator in (layers, heads):
        assert not isinstance(combinator, Rule)
        assert not [m for m in ("capacity", "position_mode", "prefill", "step", "observe", "absorb", "stats",
                                "cache_state") if hasattr(combinator, m)]
    # one layer of rolling positions among absolute ones: the plan is absolute; all rolling: not
    assert resolve(by_layer(rolling, stream, split=1), 2).absolute and not resolve(heads, 2, 2).absolute
    # SnapKV compresses a prompt once: one layer of it is enough for token-by-token scoring to refuse
    assert resolve(by_layer(stream, stream, split=1), 2).evicts_while_decoding
    assert not resolve(layers, 2).evicts_while_decoding
    with pytest.raises(ValueError, match="compresses a whole prompt once"):
        stream_logprobs(tiny.model, list(range(4, 40)), layers)


def test_the_rule_contract_is_small_and_apart_from_plan_building():
    """The base rule class has at most 11 public members (it had 25 with the plan-building ones; `layer_key`, what a
    rule reads of its layer index, came with the scan over layers); a policy,
    which builds plans, has none of a rule's; folding chunks (`ChunkRule`) and masking the prompt
    (`PromptMasking`) are rules of their own kind, and a rule that cannot fold chunks refuses the mode by name."""
    import abc

    from kvjax.policies import ChunkRule, PromptMasking, Rule

    def public(cls):
        return {n for k in cls.__mro__ if k not in (object, abc.ABC) for n in vars(k) if not n.startswith("_")}

    assert len(public(Rule)) <= 11, sorted(public(Rule))
    assert public(Policy) & public(Rule) == {"describe"}
    assert {"absorb", "make_room", "chunk_visible"} <= public(ChunkRule) - public(Rule)
    assert {"prompt_mask", "prefix_visible"} <= public(PromptMasking) - public(Rule)
    assert isinstance(KeepEvenIds(), Rule) and not isinstance(KeepEvenIds(), ChunkRule)
    with pytest.raises(ValueError, match="KeepEvenIds cannot run prefill_mode='chunked'"):
        KeepEvenIds(prefill_mode="chunked", chunk=4)


def test_kvjax_never_imports_models_or_experiments():
    """Data flows one way: kvjax.models and kvjax.experiments build on kvjax's core, never the reverse (every import
    statement of every core module, those inside functions included; `from kvjax import models` too)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    outside = ("kvjax.models", "kvjax.experiments", "models", "experiments", "benchmarks")
    bad = []
    for path in sorted(p for p in (root / "kvjax").rglob("*.py") if p.relative_to(root / "kvjax").parts[0] not in
                       ("models", "experiments")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names
                    if any(n == o or n.startswith(o + ".") for o in outside)]
    assert bad == []


def test_kvjax_reaches_into_no_private_member_of_a_model():
    """kvjax uses a model through public names (`Attention.qkv`, `.geometry`): no attribute kvjax reads is a
    private method or field defined by a class of kvjax.models."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    private = set()
    for path in (root / "kvjax" / "models").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                private |= {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                            and f.name.startswith("_") and not f.name.startswith("__")}
    core = sorted(p for p in (root / "kvjax").rglob("*.py") if p.relative_to(root / "kvjax").parts[0] != "models")
    used = [f"{path.relative_to(root)}:{node.lineno} .{node.attr}" for path in core
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in private
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]
    assert "_rotate" in private and used == []


def test_the_model_contract_is_what_generation_calls(tiny):
    """`kvjax.model.CachedLM` declares every attribute that kvjax's drivers (generation, scoring, few-shot
    evaluation, KVzip's replay, the engine) read from a model, found by walking their source, aliases included
    (`cfg = model.cfg`); of the model they read only its config and dtype and call its one forward. kvjax's Llama
    provides it, and a model without the forward does not."""
    import ast
    from pathlib import Path

    from kvjax.model import CachedLM, LMConfig

    root = Path(__file__).resolve().parents[1] / "kvjax"
    read, cfg_read, called = set(), set(), 0
    for name in ("generate.py", "scoring.py", "fewshot.py", "engine.py", "drive.py", "contract.py", "kvzip.py"):
        tree = ast.parse((root / name).read_text())
        for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
            # names bound to `model.cfg` in this function (`cfg = model.cfg`, `c = model.cfg`)
            aliases = {t.id for node in ast.walk(fn) if isinstance(node, ast.Assign)
                       and isinstance(node.value, ast.Attribute) and node.value.attr == "cfg"
                       and isinstance(node.value.value, ast.Name) and node.value.value.id == "model"
                       for t in node.targets if isinstance(t, ast.Name)}
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "model":
                    read.add(node.attr)
                cfg = isinstance(node, ast.Attribute) and (
                    (isinstance(node.value, ast.Attribute) and node.value.attr == "cfg"
                     and isinstance(node.value.value, ast.Name) and node.value.value.id == "model")
                    or (isinstance(node.value, ast.Name) and node.value.id in aliases))
                if cfg:
                    cfg_read.add(node.attr)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "model":
                    called += 1
    declared = {n for n in dir(CachedLM) if not n.startswith("_")} | set(CachedLM.__annotations__)
    assert read and read <= declared, read - declared
    assert read == {"cfg", "dtype"}, read  # the model is read for its config and dtype, and called
    config = set(LMConfig.__annotations__) | {n for n in dir(LMConfig) if not n.startswith("_")}
    assert cfg_read and cfg_read <= config, cfg_read - config
    assert {"eos_token_ids", "pad_token_id", "windows"} <= cfg_read  # what `generate` and planning read
    assert called >= 1  # the one forward, called by `kvjax.drive`
    assert isinstance(tiny.model, CachedLM)

    class NoForward:
        cfg, dtype = tiny.model.cfg, tiny.model.dtype

    assert not isinstance(NoForward(), CachedLM)


def test_each_rule_keeps_its_own_state_named_for_what_it_holds(tiny):
    """No shared `score` field: a ring keeps no statistic, H2O each slot's attention `mass`, MAT's deep layers
    each slot's `pi`, RazorAttention's local heads a `window` length and `folded` count per KV head (per-head
    state survives slot moves); a statistic the cache does not hold is an error, not a new array."""
    from kvjax.cache import with_state
    from kvjax.policies import H2O, RazorAttention, mat

    cfg = tiny.model.cfg
    b, kvh = 2, cfg.num_kv_heads
    state = lambda policy: [{n: x.shape for n, x in g.state.items()}  # noqa: E731
                            for layer in drive.empty_cache(tiny.model, drive.plan(tiny.model, policy, 64, 32), b)
                            for g in getattr(layer, "groups", (layer,))]
    assert state(StreamingLLM(budget=8, sinks=2)) == [{}] * cfg.num_layers
    assert state(H2O(budget=8, recent=2)) == [{"mass": (b, kvh, 8)}] * cfg.num_layers
    assert state(mat(8, 3, shallow_layers=1, sinks=2)) == [{}] + [{"pi": (b, kvh, 8)}] * (cfg.num_layers - 1)
    razor = RazorAttention(retrieval=((True, False),) * cfg.num_layers, buffer=4, compression=8, sinks=2)
    assert state(razor)[1] == {"recent": (b, 1), "folded": (b, 1)}  # layer 0's local head group
    cache = drive.empty_cache(tiny.model, drive.plan(tiny.model, H2O(budget=8, recent=2), 64, 32), b)[0]
    with pytest.raises(KeyError, match=r"state \['pi'\] is not in this cache \(it holds \['mass'\]"):
        with_state(cache, pi=0.0)


def test_a_policy_fits_any_models_windows_without_the_model():
    """`on_windows` (what kvjax's Llama calls for Mistral and Gemma): per-layer windows give the sliding layers a
    W-slot ring and leave the global ones to the policy, inside `Quantized` too; one window for all layers is the
    policy's own `on_sliding_window`; a window count that is not the model's depth is refused by name."""
    from kvjax.policies import PerLayer, Quantized, SnapKV, on_windows

    snap = SnapKV(budget=16, observation_window=4)
    fitted = on_windows(snap, (None, 8), 2, 2)
    assert isinstance(fitted, PerLayer) and fitted.layers[0] == snap
    assert fitted.layers[1].describe().startswith("LocalWindow(size=8")
    wrapped = on_windows(Quantized(snap, bits=8), (None, 8), 2, 2)
    assert isinstance(wrapped, Quantized) and wrapped.policy == fitted
    assert on_windows(FullCache(), 8, 2).describe().startswith("LocalWindow(size=8")
    assert on_windows(snap, None, 2) == snap
    with pytest.raises(ValueError, match="on_windows: 3 windows for a model of 2 layers"):
        on_windows(snap, (None, 8, 8), 2)
    # a quantized per-layer policy is refused only when a member really moves its cache after the prompt (the gate)
    with pytest.raises(ValueError, match=r"GateEviction\(.*moves its cache on the host"):
        Quantized(by_layer(StreamingLLM(budget=8, sinks=2), GateEviction(), split=1), bits=8)
