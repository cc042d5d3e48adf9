"""A model that scans each run of layers alike (`LlamaConfig.layer_loop="scan"`, the default) computes what the
unrolled model computes: the same generated tokens, the same kept positions and the same cached keys and values
(to float32 rounding), for every policy family, through every step a family takes (the whole prompt, a prompt read
token by token or in chunks, one pass shared by several plans, KVzip's replays and KVgrad's backward pass, the
decode loop, the plain forward with Attention-Gates). The unrolled model is the reference: it calls every layer with
its own index and its own plan, which is what the scan replaces."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import drive, layer_runs
from kvjax import step as steps
from kvjax.generate import generate, generate_many
from kvjax.policies import (
    TOVA,
    AdaKV,
    AnchorCache,
    DuoAttention,
    DuoAttentionOnce,
    ExpectedAttention,
    FullCache,
    GateEviction,
    H2O,
    KeyDiff,
    KNorm,
    KVgrad,
    KVzip,
    PyramidKV,
    Quantized,
    RazorAttention,
    SlimKV,
    SnapKV,
    StreamingLLM,
    mat,
)
from kvjax.policies.anllm import AnchorReduction
from kvjax.policies.scored import PromptStreamingLLM
from kvjax.policies.chunkkv import ChunkKV
from kvjax.policies.critical import CriticalAdaKV, CriticalKV
from kvjax.models import load
from kvjax.models.tiny import make_random_checkpoint, tiny_config

LAYERS = 6
ANCHOR = 10
# Layers 0-1 and 4-5 alike, 2-3 another: RazorAttention's and DuoAttention's head tables make three runs
RETRIEVAL = ((True, False), (True, False), (False, True), (False, True), (True, False), (True, False))
KV = dict(repeat_ids=(1,), continue_ids=(2,), suffix_ids=(), chunk_size=16)

FAMILIES = {
    "full": FullCache(),
    "streaming": StreamingLLM(budget=16, sinks=4),
    "streaming-stream": StreamingLLM(budget=16, sinks=4, prefill_mode="stream"),
    "streaming-chunked": StreamingLLM(budget=16, sinks=4, prefill_mode="chunked", chunk=8),
    "h2o": H2O(budget=16, recent=4),
    "snapkv": SnapKV(ratio=0.5, observation_window=4),
    "pyramidkv": PyramidKV(budget=24, observation_window=4, beta=2, num_layers=LAYERS),
    "slimkv": SlimKV(ratio=0.5, observation_window=4),
    "tova": TOVA(ratio=0.5),
    "knorm": KNorm(ratio=0.5),
    "expected-attention": ExpectedAttention(ratio=0.5),
    "keydiff": KeyDiff(ratio=0.5),
    "adakv": AdaKV(scorer=SnapKV(ratio=0.5, observation_window=4)),
    "criticalkv": CriticalKV(scorer=SnapKV(ratio=0.5, observation_window=4)),
    "critical-adakv": CriticalAdaKV(scorer=SnapKV(ratio=0.5, observation_window=4)),
    "chunkkv": ChunkKV(scorer=SnapKV(ratio=0.5, observation_window=4), chunk_length=4),
    "mat": mat(24, anchor_slots=6, shallow_layers=2),
    "anchor-cache": AnchorCache(budget=24, anchor_slots=6),
    "anllm": AnchorReduction(anchor_ids=(ANCHOR,), anchor_slots=8, sequence=8),
    "razor": RazorAttention(retrieval=RETRIEVAL, buffer=8, sinks=2, compression=3),
    "duo": DuoAttention(streaming=tuple(tuple(not r for r in row) for row in RETRIEVAL), sinks=2, recent=8),
    "duo-kvpress": DuoAttentionOnce(streaming=tuple(tuple(not r for r in row) for row in RETRIEVAL), sinks=2, recent=8),
    "streaming-kvpress": PromptStreamingLLM(budget=16, sinks=4),
    "kivi": Quantized(FullCache(), bits=2, group=8, residual=4),
    "kvzip": KVzip(ratio=0.5, **KV),
    "kvzip-plus": KVzip(ratio=0.5, plus=True, **KV),
    "kvgrad": KVgrad(ratio=0.5, **KV),
    "gate": GateEviction(bucket=8),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The same random checkpoint (6 layers, large weights: peaked attention, so rules see scores that differ),
    loaded scanned and unrolled, both with the same Attention-Gates (eviction-prone: gamma 0, about half evicted)."""
    from kvjax.gate import GateConfig, attach_gates

    path = make_random_checkpoint(tmp_path_factory.mktemp("scan"), tiny_config(num_layers=LAYERS), seed=3,
                                  init_std=0.3)
    out = []
    for loop in ("scan", "unroll"):
        lm = load(path, layer_loop=loop)
        attach_gates(lm.model, GateConfig(gamma=0.0), seed=5)
        out.append(lm.model)
    return out


@pytest.fixture(params=["stacked", pytest.param("picked", marks=pytest.mark.slow)])
def parameters(request, monkeypatch):
    """A scanned run's parameters stacked (the CPU's way) or picked per iteration by a switch (the accelerators':
    `kvjax.models.llama.stacks_parameters`), each compiled afresh; the accelerators' way under `pytest -m slow`
    (about 30 s on 2 cores), and compiled for TPU in `tests/test_tpu_aot.py`'s whole-model compiles."""
    from kvjax.models import llama

    monkeypatch.setattr(llama, "stacks_parameters", lambda: request.param == "stacked")
    jax.clear_caches()
    yield request.param
    jax.clear_caches()


def _prompts():
    rng = np.random.RandomState(0)
    a, b = rng.randint(4, 200, 45).tolist(), rng.randint(4, 200, 33).tolist()
    for i in (7, 15, 22, 30, 40):  # AnLLM's anchors
        a[i] = ANCHOR
    b[12] = b[25] = ANCHOR
    return [a, b]


def _same(scanned, unrolled, norm=False):
    """Every leaf: integers (kept positions, codes, counters) equal; floats to float32 rounding, each within 1e-5 of
    the leaf's largest magnitude (a summation order may differ), or with `norm` to 1e-4 of the leaf's norm (the
    gradients of this sharp model reach 1e11, where single elements cancel)."""
    leaves_s, tree_s = jax.tree.flatten(scanned)
    leaves_u, tree_u = jax.tree.flatten(unrolled)
    assert tree_s == tree_u
    for s, u in zip(leaves_s, leaves_u):
        s, u = np.asarray(s), np.asarray(u)
        if not np.issubdtype(s.dtype, np.floating):
            np.testing.assert_array_equal(s, u)
        elif norm:
            assert np.linalg.norm(s - u) <= 1e-4 * np.linalg.norm(u)
        else:
            np.testing.assert_allclose(s, u, rtol=1e-4, atol=1e-5 * max(1.0, float(np.max(np.abs(u), initial=0))))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_scanned_model_generates_what_the_unrolled_one_does(models, name):
    """Greedy generation (the family's prompt pass, then the decode loop), a batch of two prompts of different
    lengths: the same tokens, the same final cache (kept positions equal, keys and values to rounding), the same
    held bytes; and the scanned model did run fewer layer bodies than layers (except where the plan tells every
    layer apart: PyramidKV's per-layer budgets)."""
    scanned, unrolled = models
    policy = FAMILIES[name]
    g_s = generate(scanned, _prompts(), policy, max_new_tokens=5)
    g_u = generate(unrolled, _prompts(), policy, max_new_tokens=5)
    assert g_s.sequences() == g_u.sequences()
    _same(g_s.cache, g_u.cache)
    np.testing.assert_array_equal(g_s.held_bytes, g_u.held_bytes)
    plan = drive.plan(scanned, policy, 64, 48)
    prompt = steps.Chunk(plan) if policy.prefill_mode == "chunked" else steps.Prompt(plan) \
        if policy.prefill_mode == "full" else steps.Token(plan)
    runs = layer_runs.split(prompt.layer_runs(LAYERS), scanned.structure_runs())
    if name == "pyramidkv" or policy.prefill_mode == "stream":  # a token's step is unrolled (`Token.layer_runs`)
        assert runs == layer_runs.every_layer(LAYERS)
    else:
        assert len(runs) < LAYERS, runs


def test_scanned_prompt_logits_and_shared_pass_match_the_unrolled_model(models, parameters):
    """The prompt's logits under whole, streamed and chunked reads, and one plain pass shared by three plans (the
    caches of each), scanned (the parameters stacked or picked) and unrolled."""
    scanned, unrolled = models
    ids = _prompts()[0]
    tokens = jnp.asarray([ids])
    positions = jnp.arange(len(ids))[None]
    for policy in (SnapKV(ratio=0.5, observation_window=4), FAMILIES["streaming-stream"],
                   FAMILIES["streaming-chunked"], FAMILIES["mat"], FAMILIES["razor"]):
        plan = drive.plan(scanned, policy, 64, len(ids))
        (ls, cs), (lu, cu) = (drive.prompt(m, tokens, positions, plan) for m in (scanned, unrolled))
        _same(ls, lu)
        _same(cs, cu)
    plans = tuple(drive.plan(scanned, p, 64, len(ids)) for p in (SnapKV(ratio=0.5), TOVA(ratio=0.75), KNorm(budget=9)))
    (ls, cs), (lu, cu) = (drive.shared(m, tokens, positions, plans) for m in (scanned, unrolled))
    _same(ls, lu)
    _same(cs, cu)
    many_s = generate_many(scanned, _prompts(), [FAMILIES["snapkv"], FAMILIES["tova"], FAMILIES["mat"]],
                           max_new_tokens=4)
    many_u = generate_many(unrolled, _prompts(), [FAMILIES["snapkv"], FAMILIES["tova"], FAMILIES["mat"]],
                           max_new_tokens=4)
    assert [g.sequences() for g in many_s] == [g.sequences() for g in many_u]


def test_scanned_plain_forward_gives_the_unrolled_logits_gate_flags_and_gradients(models, parameters):
    """The plain forward (training's): every position's logits, each layer's gate flags, and the gradient of a loss
    with respect to every parameter, scanned (the parameters stacked or picked) and unrolled."""
    from flax import nnx

    scanned, unrolled = models
    tokens = jnp.asarray([_prompts()[0]])
    (ls, fs), (lu, fu) = drive.forward(scanned, tokens), drive.forward(unrolled, tokens)
    _same(ls, lu)
    assert len(fs) == LAYERS
    _same(fs, fu)

    def loss(model):
        logits, flags = drive.forward(model, tokens)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 5]) + sum(jnp.mean(f) for f in flags)

    gs, gu = nnx.grad(loss)(scanned), nnx.grad(loss)(unrolled)
    _same(gs, gu, norm=True)


def test_a_plan_runs_its_layers_alike_only_where_its_rules_agree(models):
    """`Plan.runs`: neighbouring layers with equal plans but for the index and rules that read nothing of the index
    are one run; MAT's shallow and deep layers are two; RazorAttention's head tables make a run of each stretch of
    equal tables; PyramidKV's rule reads its layer (each layer's budget), so every layer is its own run even where
    two layers' slot counts agree."""
    scanned, _ = models
    runs = lambda p: drive.plan(scanned, p, 64, 48).runs()  # noqa: E731
    assert runs(SnapKV(ratio=0.5)) == ((0, LAYERS),)
    assert runs(FAMILIES["mat"]) == ((0, 2), (2, LAYERS))
    assert runs(FAMILIES["razor"]) == ((0, 2), (2, 4), (4, 6))
    assert runs(FAMILIES["pyramidkv"]) == layer_runs.every_layer(LAYERS)
    flat = PyramidKV(budget=24, observation_window=4, beta=2, num_layers=LAYERS)
    assert flat.layer_key(0) != flat.layer_key(1)
    assert CriticalKV(scorer=flat).layer_key(0) != CriticalKV(scorer=flat).layer_key(1)  # held rules are read
    assert SnapKV(ratio=0.5).layer_key(0) == SnapKV(ratio=0.5).layer_key(3) is None
    assert layer_runs.split(((0, 2), (2, 6)), ((0, 4), (4, 6))) == ((0, 2), (2, 4), (4, 6))


def test_layer_loop_is_checked(tmp_path):
    with pytest.raises(ValueError, match="layer_loop='loop'"):
        dataclasses.replace(tiny_config(), layer_loop="loop")
