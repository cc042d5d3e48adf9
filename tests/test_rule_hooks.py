"""The rule contract is in the types: every hook kvjax reads from a rule or a policy is declared on `Rule`,
`Policy` or a kind of rule (`PooledRule`, `StepOnlyWrites`, ...), and nothing probes a rule for an attribute it
may lack (`getattr(rule, "pools_heads", False)` was how a pooled rule was told apart)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from kvjax.errors import InvalidInput
from kvjax.policies import (
    H2O,
    TOVA,
    AdaKV,
    AnchorCache,
    CompensatedWindow,
    FullCache,
    GateEviction,
    KVzip,
    LayerPolicy,
    LocalWindow,
    PerLayer,
    Policy,
    PooledRule,
    Quantized,
    recompress,
    SnapKV,
    StepOnlyWrites,
    StreamingLLM,
    by_head,
    by_layer,
    reduces_to,
    resolve,
)

ROOT = Path(__file__).resolve().parents[1]


def test_no_rule_or_policy_is_probed_for_an_attribute():
    """No `getattr(x, "name"[, default])` or `hasattr(x, "name")` in kvjax/ names a member that a class of
    kvjax/policies/ defines: such a hook is declared, so it is read as `x.name`, or its kind is asked with
    `isinstance` (a tokenizer's `chat_template`, a leaf's `sharding` are other libraries' names)."""
    members = set()
    for path in (ROOT / "kvjax" / "policies").glob("*.py"):
        for cls in [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]:
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(node.name)
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, ast.AnnAssign) else []
                members |= {t.id for t in targets if isinstance(t, ast.Name)}
    members = {m for m in members if not (m.startswith("__") and m.endswith("__"))}  # Python's protocols, no hooks
    assert {"pool_capacity", "same_as", "step", "cache_state", "members"} <= members
    probes = []
    core = [p for p in sorted((ROOT / "kvjax").rglob("*.py"))
            if p.relative_to(ROOT / "kvjax").parts[0] not in ("models", "experiments")]
    for path in core:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in members):
                probes.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert probes == []


def test_a_pooled_rule_is_one_by_its_class():
    """A layer is pooled when its rule is a `PooledRule` (AdaKV), which must say its pool's size; a class
    attribute spelled like the old flag makes no pool, and a pooled rule is refused in a head group."""
    ada = AdaKV(scorer=SnapKV(budget=16, observation_window=4))
    assert isinstance(ada, PooledRule)
    lp = resolve(ada, 2, 2).sized(64, 32).layers[0]
    assert lp.pooled and lp.sizes == (16, 32) and lp.capacities(64, 32) == ada.pool_capacity(0, 64, 32)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class FlaggedRing(StreamingLLM):
        pools_heads = True

    assert not resolve(FlaggedRing(budget=8), 2, 2).layers[0].pooled

    class NoSize(PooledRule, FullCache):
        pass

    with pytest.raises(TypeError, match="pool_capacity"):
        NoSize()
    with pytest.raises(InvalidInput, match="cannot cache one head group of layer 0"):
        resolve(by_head([[True, False]] * 2, ada, StreamingLLM(budget=8)), 2, 2)


def test_which_rules_read_no_cached_key_in_their_step_is_their_class():
    """`StepOnlyWrites` marks the rules whose `step` only writes the new token, which a quantized cache decodes
    from its codes; RazorAttention's compensation token (it averages evicted keys), Decoding, MAT and the gate
    read or keep what the rule computes from the cache, and are not marked."""
    snap = SnapKV(budget=16, observation_window=4)
    marked = [FullCache(), StreamingLLM(budget=8), LocalWindow(size=8), H2O(budget=8), snap, TOVA(budget=8),
              KVzip(ratio=0.5, repeat_ids=(1,), continue_ids=(2,), suffix_ids=()), AdaKV(scorer=snap)]
    unmarked = [CompensatedWindow(buffer=4, compression=2.0), recompress(snap, 8), GateEviction(),
                AnchorCache(budget=16, anchor_slots=4)]
    assert [type(r).__name__ for r in marked if not isinstance(r, StepOnlyWrites)] == []
    assert [type(r).__name__ for r in unmarked if isinstance(r, StepOnlyWrites)] == []


def test_a_layer_plan_holds_a_rule_or_a_head_split_in_separate_fields():
    """`LayerPlan.rule` is always a rule (the layer's only one); a split layer has its groups' rules and the policy
    that split it (`split_by`), and asking it for one rule is refused by name. A policy that hands a layer
    something that is no rule is refused when the plan is built."""
    stream = StreamingLLM(budget=8)
    split = by_head([[True, False]] * 2, FullCache(), stream)
    whole, heads = resolve(by_layer(stream, split, split=1), 2, 2).layers
    assert whole.rule == stream and whole.split_by is None and not whole.split
    assert heads.split_by == split and [g.rule for g in heads.groups] == [FullCache(), stream]
    assert heads.describe() == f"KV heads [0]: {FullCache().describe()}; KV heads [1]: {stream.describe()}"
    with pytest.raises(InvalidInput, match="layer 1: KV heads .0.: FullCache.* split into groups"):
        heads.rule  # noqa: B018

    @dataclasses.dataclass(frozen=True)
    class Builder(Policy):  # builds plans only: no rule
        prefill_mode: str = "full"

    with pytest.raises(InvalidInput, match="Builder.* is given layer 0 to cache, but it is no Rule"):
        resolve(Builder(), 1, 2)


def test_a_policy_says_its_members_and_what_it_reduces_to_by_declared_methods():
    """`Policy.members()` (a layer dispatch's members; none otherwise) is what `Quantized` checks for a member that
    moves its cache after the prompt; `Policy.same_as()` (None unless overridden: PyramidKV) is what the tables
    print."""
    stream, snap = StreamingLLM(budget=8), SnapKV(budget=16, observation_window=4)
    assert by_layer(stream, snap, split=1).members() == (stream, snap)
    assert PerLayer(layers=(stream, snap, stream)).members() == (stream, snap, stream)
    assert stream.members() == () and by_head([[True]], stream, snap).members() == ()
    with pytest.raises(InvalidInput, match=r"^GateEviction\(.*\) moves its cache on the host"):
        Quantized(by_layer(stream, by_layer(stream, GateEviction(), split=1), split=1), bits=8)
    assert Quantized(by_layer(stream, snap, split=1), bits=8).policy.members() == (stream, snap)
    assert isinstance(stream, LayerPolicy) and stream.same_as() is None and reduces_to(stream) is None
