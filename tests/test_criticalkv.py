"""CriticalKV / CriticalAdaKV (`kvjax.policies.critical`): kept positions per layer and KV head, and the next token's
logits, equal to kvpress 0.5.5's CriticalKVPress / CriticalAdaKVPress on a random hidden-size-64 GQA Llama; rows of a
batch compressed alone; a model without an output projection refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import layer
from kvjax.cache import kept_sets
from kvjax.errors import InvalidInput
from kvjax.policies import KNorm, SnapKV, make_policy, resolve
from kvjax.policies.critical import CriticalAdaKV, CriticalKV
from tests.conftest import left_pad, sdpa_llama, stepper

torch = pytest.importorskip("torch")
kvpress = pytest.importorskip("kvpress")

T, WINDOW, KERNEL = 100, 16, 5


@pytest.fixture(scope="module")
def sdpa_pair(tmp_path_factory):
    return sdpa_llama(tmp_path_factory.mktemp("criticalkv"), seed=3)


def scorers(ratio):
    return {"snapkv": (SnapKV(ratio=ratio, observation_window=WINDOW, kernel=KERNEL, pool="avg", group_agg="mean"),
                       kvpress.SnapKVPress(compression_ratio=ratio, window_size=WINDOW, kernel_size=KERNEL)),
            "knorm": (KNorm(ratio=ratio), kvpress.KnormPress(compression_ratio=ratio))}


def run_kvpress(pt, press, ids):
    """kvpress's compressed cache (its keys, before decoding appends) and the next token's logits."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        with press(pt):
            pt(torch.tensor(ids[None, :T]), past_key_values=cache)
        keys = [lc.keys[0].clone() for lc in cache.layers]
        logits = pt(torch.tensor([[ids[T]]]), past_key_values=cache, position_ids=torch.tensor([[T]])).logits[0, -1]
    return keys, logits.numpy()


def run_ours(model, policy, ids):
    prefill, decode = stepper(model, policy, 128 + 1)
    _, cache = prefill(*left_pad(ids[:T].tolist(), 128))
    logits, _ = decode(jnp.asarray([ids[T]], jnp.int32), jnp.asarray([T], jnp.int32), cache)
    return cache, np.asarray(logits[0])


@pytest.mark.parametrize("scorer, ratio, epsilon, first", [("snapkv", 0.5, 1e-4, 0.5), ("snapkv", 0.75, 0.02, 0.8),
                                                           ("knorm", 0.6, 1e-4, 0.5)])
def test_criticalkv_kept_positions_and_next_logits_match_kvpress(sdpa_pair, scorer, ratio, epsilon, first):
    """CriticalKV(scorer) keeps, per layer and KV head, the positions kvpress's CriticalKVPress(press) keeps (found by
    matching its compressed keys in the uncompressed cache), and the next token's logits agree; the two stages
    matter: the scorer alone keeps other positions."""
    from transformers import DynamicCache

    pt, model = sdpa_pair
    ours, theirs = scorers(ratio)[scorer]
    ids = np.random.RandomState(11).randint(0, 97, T + 1)
    kept_theirs, logits_theirs = run_kvpress(pt, kvpress.CriticalKVPress(theirs, epsilon=epsilon,
                                                                         first_stage_ratio=first), ids)
    full = DynamicCache()
    with torch.no_grad():
        pt(torch.tensor(ids[None, :T]), past_key_values=full)
    cache, logits = run_ours(model, CriticalKV(scorer=ours, epsilon=epsilon, first_stage_ratio=first), ids)
    kept, alone = kept_sets(cache), kept_sets(run_ours(model, ours, ids)[0])
    differs = False
    for i in range(3):
        fk = full.layers[i].keys[0]
        for h in range(2):
            want = sorted(int(torch.where((fk[h] == row).all(-1))[0][0]) for row in kept_theirs[i][h])
            assert kept[i][h] == want, (scorer, ratio, i, h)
            differs |= kept[i][h] != alone[i][h]
    assert differs
    assert np.abs(logits_theirs).max() > 0.5
    np.testing.assert_allclose(logits, logits_theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("ratio", [0.5, 0.8])
def test_critical_adakv_kept_positions_per_head_match_kvpress(sdpa_pair, ratio):
    """CriticalAdaKV(SnapKV): the positions each KV head keeps (AdaKV's head budgets, then the two stages per head) are
    those kvpress's CriticalAdaKVPress leaves unmasked; the heads keep different counts summing to the layer's budget;
    the next token's logits (each head attending its own slots of the pool) agree."""
    pt, model = sdpa_pair
    ours, theirs = scorers(ratio)["snapkv"]
    ids = np.random.RandomState(12).randint(0, 97, T + 1)
    _, logits_theirs = run_kvpress(pt, kvpress.CriticalAdaKVPress(press=theirs, alpha_safeguard=0.2), ids)
    cache, logits = run_ours(model, CriticalAdaKV(scorer=ours, alpha=0.2), ids)
    np.testing.assert_allclose(logits, logits_theirs, atol=1e-4, rtol=0)
    kept, varied = kept_sets(cache), False
    for i in range(3):
        masked = pt.model.layers[i].self_attn.masked_key_indices
        for h in range(2):
            gone = {int(s) for b, hh, s in zip(*masked) if int(hh) == h}
            assert kept[i][h] == sorted(set(range(T)) - gone), (ratio, i, h)
        assert sum(len(x) for x in kept[i]) == 2 * int(T * (1 - ratio))
        varied |= len(kept[i][0]) != len(kept[i][1])
    assert varied


def test_rows_of_a_batch_are_compressed_alone(sdpa_pair):
    """Two prompts of different lengths, left padded in one batch, keep what each keeps alone (its own count)."""
    _, model = sdpa_pair
    policy = CriticalKV(scorer=SnapKV(ratio=0.5, observation_window=WINDOW, kernel=KERNEL, pool="avg"))
    rows = [np.random.RandomState(s).randint(0, 97, n).tolist() for s, n in ((1, 90), (2, 61))]
    tokens, positions = zip(*(left_pad(r, 96) for r in rows))
    prefill, _ = stepper(model, policy, 97)
    _, both = prefill(jnp.concatenate(tokens), jnp.concatenate(positions))
    for b, r in enumerate(rows):
        _, alone = prefill(*left_pad(r, 96))
        row = kept_sets(jax.tree.map(lambda x: x[b:b + 1], both))
        assert row == kept_sets(alone)
        assert all(len(x) == len(r) // 2 for lay in row for x in lay)


def test_a_model_without_an_output_projection_is_refused():
    """The rule asks for ‖v W_o‖; a model whose geometry has no `out_proj` gets one line naming the field."""
    policy = CriticalKV(scorer=KNorm(budget=4))
    plan = resolve(policy, 1, 2).sized(9, 8)
    geom = layer.Geometry(layer=0, num_heads=4, num_kv_heads=2, head_dim=8, scale=8 ** -0.5)
    q, kv = jnp.ones((1, 4, 8, 8)), jnp.ones((1, 2, 8, 8))
    cache = layer.init_layer_cache(plan.layers[0], 1, 2, 8, jnp.float32)
    with pytest.raises(InvalidInput, match=r"Geometry\.out_proj is None") as e:
        layer.prefill(geom, plan.layers[0], cache, q, kv, kv, jnp.arange(8)[None])
    assert "\n" not in str(e.value) and "CriticalKV" in str(e.value)


def test_registry_and_refusals():
    assert make_policy("criticalkv", ratio=0.5) == CriticalKV(scorer=SnapKV(ratio=0.5))
    assert make_policy("critical-adakv", ratio=0.5, adakv_alpha=0.3) == CriticalAdaKV(scorer=SnapKV(ratio=0.5), alpha=0.3)
    with pytest.raises(InvalidInput, match="cannot run prefill_mode='chunked'"):
        CriticalKV(scorer=SnapKV(budget=32, prefill_mode="chunked", chunk=32))
    with pytest.raises(InvalidInput, match="first_stage_ratio"):
        CriticalKV(scorer=SnapKV(budget=32), first_stage_ratio=1.5)
    with pytest.raises(InvalidInput, match="not a prompt compressor"):
        CriticalKV(scorer=make_policy("streaming", 16))


def test_command_line_flags_reach_criticalkv_and_chunkkv():
    """`--epsilon`, `--first-stage-ratio` (CriticalKV, CriticalAdaKV) and `--chunk-length` (ChunkKV) reach the policy
    they belong to; given to a policy that does not take them, they are refused by name."""
    import argparse

    from kvjax.experiments.common import add_policy_args, policy_from_args
    from kvjax.errors import InvalidInput
    from kvjax.policies.chunkkv import ChunkKV

    p = argparse.ArgumentParser()
    add_policy_args(p, default="snapkv", budget=128)
    got = policy_from_args(p.parse_args(["--policy", "criticalkv", "--ratio", "0.5", "--epsilon", "0.01",
                                         "--first-stage-ratio", "0.25"]))
    assert got == CriticalKV(scorer=SnapKV(ratio=0.5), epsilon=0.01, first_stage_ratio=0.25)
    got = policy_from_args(p.parse_args(["--policy", "critical-adakv", "--ratio", "0.5", "--epsilon", "0.01"]))
    assert got.epsilon == 0.01 and got.first_stage_ratio == 0.5
    got = policy_from_args(p.parse_args(["--policy", "chunkkv", "--ratio", "0.5", "--chunk-length", "8"]))
    assert got == ChunkKV(scorer=SnapKV(ratio=0.5), chunk_length=8)
    for flag in (["--epsilon", "0.01"], ["--chunk-length", "8"], ["--first-stage-ratio", "0.3"]):
        with pytest.raises(InvalidInput, match=flag[0]):
            policy_from_args(p.parse_args(["--policy", "snapkv", "--ratio", "0.5", *flag]))
