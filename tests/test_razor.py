"""RazorAttention: the compensation identity, kept positions and logits vs a plain-Python
reference, head-wise caches whose bytes follow the formula, ALiBi vision scopes, errors."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax import FullCache, attention, generate
from kvjax.cache import HeadwiseCache
from kvjax.errors import InvalidInput
from kvjax.heads import alibi_scopes, attention_maps, kv_scopes, save_heads
from kvjax.policies import RazorAttention, make_policy, razor_from_heads
from kvjax.policies.razor import CompensatedWindow
from kvjax.models import load
from kvjax.models.llama import Llama
from kvjax.models.tiny import tiny_config
from tests.conftest import left_pad, random_ids, stepper
from tests.reference import RefLlama
from kvjax import drive

RETRIEVAL = ((True, False), (False, True))  # layer x KV head, for the 2-layer, 2-KV-head test models


def test_compensation_identity():
    """Eq. 5: a compensation slot with bias log N_d == full attention where the dropped tokens are
    N_d copies of (k_hat, v_hat)."""
    rng = np.random.default_rng(0)
    b, kvh, g, d, kept, n_d = 2, 2, 4, 16, 9, 7
    q = rng.normal(size=(b, kvh * g, d)).astype(np.float32)
    k = rng.normal(size=(b, kvh, kept, d)).astype(np.float32)
    v = rng.normal(size=(b, kvh, kept, d)).astype(np.float32)
    k_hat = rng.normal(size=(b, kvh, 1, d)).astype(np.float32)
    v_hat = rng.normal(size=(b, kvh, 1, d)).astype(np.float32)
    pos = np.broadcast_to(np.arange(kept + 1), (b, kvh, kept + 1)).astype(np.int32)
    log_w = np.zeros((b, kvh, kept + 1), np.float32)
    log_w[..., -1] = math.log(n_d)
    ours, _ = attention.decode_attention(
        q, np.concatenate([k, k_hat], 2), np.concatenate([v, v_hat], 2), pos, log_w, scale=d**-0.5
    )
    k_rep = np.concatenate([k, np.repeat(k_hat, n_d, 2)], 2)
    v_rep = np.concatenate([v, np.repeat(v_hat, n_d, 2)], 2)
    pos_rep = np.broadcast_to(np.arange(kept + n_d), (b, kvh, kept + n_d)).astype(np.int32)
    full, _ = attention.decode_attention(q, k_rep, v_rep, pos_rep, np.zeros_like(pos_rep, np.float32), scale=d**-0.5)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(full), atol=1e-6, rtol=0)


# --- plain-Python RazorAttention on RefLlama's per-head entry lists --------------------------------


def _window(n, buffer, compression):
    return max(buffer, math.ceil(n / compression))


def _compress_prompt(ref, entries, n, win, sinks):
    """Algorithm 1 on one head's prompt entries: sinks + the last `win` tokens + a compensation token."""
    keep = [e for e in entries if e["pos"] < sinks or e["pos"] >= n - win]
    dropped = [e for e in entries if not (e["pos"] < sinks or e["pos"] >= n - win)]
    if not dropped:
        return keep
    comp = {
        "comp": True,
        "pos": max(e["pos"] for e in dropped),
        "n": len(dropped),
        "k_rot": np.mean([ref.rope(e["k"], e["pos"]) for e in dropped], axis=0),
        "v": np.mean([e["v"] for e in dropped], axis=0),
    }
    comp["log_w"] = math.log(comp["n"])
    return keep + [comp]


def _decode_update(ref, retrieval, win, sinks, fold):
    def update(layer, entries, new, head):
        entries = entries + [new]
        if retrieval[layer][head] or fold == "prefill":
            return entries
        window = [e for e in entries if not e.get("comp") and e["pos"] >= sinks]
        if len(window) <= win:
            return entries
        old = min(window, key=lambda e: e["pos"])
        comps = [e for e in entries if e.get("comp")]
        comp = comps[0] if comps else {"comp": True, "n": 0, "k_rot": 0.0, "v": 0.0}
        n = comp["n"] + 1  # the count-weighted running mean
        comp = {
            "comp": True, "pos": old["pos"], "n": n,
            "k_rot": (comp["n"] * comp["k_rot"] + ref.rope(old["k"], old["pos"])) / n,
            "v": (comp["n"] * comp["v"] + old["v"]) / n,
            "log_w": math.log(n),
        }
        return [e for e in entries if e is not old and not e.get("comp")] + [comp]

    update.per_head = True
    return update


def _reference_run(ref, ids, prompt_len, steps, retrieval, sinks, buffer, compression, fold):
    caches = ref.empty_caches()
    logits = [ref.prefill(ids[:prompt_len], caches, lambda layer, entries, new: entries + [new])]
    win = _window(prompt_len, buffer, compression)
    for i in range(ref.L):
        for j in range(ref.kvh):
            if not retrieval[i][j]:
                caches[i][j] = _compress_prompt(ref, caches[i][j], prompt_len, win, sinks)
    kept = [_snapshot(caches)]
    update = _decode_update(ref, retrieval, win, sinks, fold)
    for t in range(prompt_len, prompt_len + steps):
        logits.append(ref.step(ids[t], t, caches, update, rolling=False))
        kept.append(_snapshot(caches))
    return np.stack(logits), kept


def _snapshot(caches):
    """Per layer, per head: (kept positions, compensation (last pos, N_d, k_hat) or None)."""
    out = []
    for layer in caches:
        row = []
        for entries in layer:
            comps = [e for e in entries if e.get("comp")]
            c = comps[0] if comps else None
            row.append((sorted(e["pos"] for e in entries if not e.get("comp")),
                        None if c is None else (c["pos"], c["n"], np.asarray(c["k_rot"]))))
        out.append(row)
    return out


def _ours_snapshot(policy, cache, row):
    out = []
    for layer, lc in enumerate(cache):
        heads = {}
        for (hs, sub), g in zip(policy.head_split(layer), lc.groups):
            pos, k = np.asarray(g.pos[row]), np.asarray(g.k[row])
            comp_slot = isinstance(sub, CompensatedWindow) and sub.compensate
            folded = np.asarray(g.state["folded"][row]) if comp_slot else None  # [kvh]: N_d per head
            for local, h in enumerate(hs):
                p = pos[local, :-1] if comp_slot else pos[local]
                comp = None
                if comp_slot and pos[local, -1] >= 0:
                    comp = (int(pos[local, -1]), int(folded[local]), k[local, -1])
                heads[h] = (sorted(int(x) for x in p if x >= 0), comp)
        out.append([heads[h] for h in range(len(heads))])
    return out


@pytest.mark.parametrize("fold", ["decode", "prefill"])
def test_kept_positions_and_logits_match_reference(sharp_dir, fold):
    """Prefill and 30 decode steps, a batch of two prompts with different N (so different N / C):
    per head, kept positions, the compensation token (last position, N_d, k_hat) and the logits
    equal the plain-Python reference; the head groups' bytes equal the formula."""
    sinks, buffer, compression, steps, bucket = 2, 6, 4.0, 30, 64
    lengths = (40, 17)  # L = max(6, 10) = 10 and max(6, 5) = 6
    ids = [random_ids(lengths[r] + steps, 260, seed=20 + r) for r in range(2)]
    policy = RazorAttention(retrieval=RETRIEVAL, compression=compression, buffer=buffer, sinks=sinks, fold=fold)
    lm = load(sharp_dir)
    max_len = bucket + steps
    prefill, decode = stepper(lm.model, policy, max_len)
    toks = np.zeros((2, bucket), np.int32)
    pos = np.full((2, bucket), -1, np.int32)
    for r, n in enumerate(lengths):
        toks[r, bucket - n :] = ids[r][:n]
        pos[r, bucket - n :] = np.arange(n)
    logits, cache = prefill(jnp.asarray(toks), jnp.asarray(pos))
    ours_logits, ours_kept = [np.asarray(logits)], [[_ours_snapshot(policy, cache, r) for r in range(2)]]
    for s in range(steps):
        step_tok = jnp.asarray([ids[r][lengths[r] + s] for r in range(2)])
        logits, cache = decode(step_tok, jnp.asarray([lengths[r] + s for r in range(2)]), cache)
        ours_logits.append(np.asarray(logits))
        ours_kept.append([_ours_snapshot(policy, cache, r) for r in range(2)])

    ref = RefLlama(sharp_dir)
    compensated = 0
    for r, n in enumerate(lengths):
        ref_logits, ref_kept = _reference_run(ref, ids[r], n, steps, RETRIEVAL, sinks, buffer, compression, fold)
        assert np.abs(ref_logits).max() > 0.5  # a sharp model: not a comparison of near-zeros
        np.testing.assert_allclose(np.stack([x[r] for x in ours_logits]), ref_logits, atol=1e-4, rtol=0)
        for t, (ours, theirs) in enumerate(zip(ours_kept, ref_kept)):
            for layer in range(2):
                for h in range(2):
                    (op, oc), (rp, rc) = ours[r][layer][h], theirs[layer][h]
                    assert op == rp, (r, t, layer, h)
                    assert (oc is None) == (rc is None), (r, t, layer, h)
                    if oc is not None:
                        compensated += 1
                        assert oc[:2] == rc[:2], (r, t, layer, h)
                        np.testing.assert_allclose(oc[2], rc[2], atol=1e-4)
    assert compensated > 0

    # Bytes: retrieval heads keep max_len slots; local heads sinks + L_max + 1 (+ room to append).
    l_max = _window(bucket, buffer, compression)
    local = sinks + l_max + 1 + (steps if fold == "prefill" else 0)
    hd, per_slot = lm.config.head_dim, 2 * lm.config.head_dim * 4 + 2 * 4  # k, v float32; pos, log_w
    per_local_head = 2 * 4  # the local heads' own state per KV head: window length L and folded count N_d
    expect = sum(2 * ((sum(row) * max_len + (len(row) - sum(row)) * local) * per_slot
                      + (len(row) - sum(row)) * per_local_head) for row in RETRIEVAL)
    assert all(isinstance(c, HeadwiseCache) for c in cache)
    assert sum(c.nbytes for c in cache) == expect
    assert [[g.capacity for g in c.groups] for c in cache] == [[max_len, local]] * 2
    del hd


def test_no_drop_is_full_cache_and_generate_runs(tiny):
    """With a buffer longer than the sequence nothing is dropped: the tokens equal FullCache's,
    through `generate` (jitted while loop, donated head-wise cache)."""
    prompts = [random_ids(20, 260, seed=3), random_ids(9, 260, seed=4)]
    kw = dict(max_new_tokens=12, key=jax.random.key(0))
    full = generate(tiny.model, prompts, FullCache(), **kw)
    razor = generate(tiny.model, prompts, RazorAttention(retrieval=RETRIEVAL, buffer=64, sinks=2), **kw)
    np.testing.assert_array_equal(np.asarray(razor.tokens), np.asarray(full.tokens))
    short = generate(tiny.model, prompts, RazorAttention(retrieval=RETRIEVAL, buffer=4, compression=8, sinks=2), **kw)
    assert short.cache[0].groups[1].capacity == 2 + 4 + 1  # the local heads hold 7 slots


def test_heads_file_and_cli_policy(tmp_path, tiny):
    path = tmp_path / "heads.json"
    save_heads(path, num_layers=2, num_heads=4, num_kv_heads=2, retrieval_kv_heads=[[1, 0], [0, 1]])
    policy = make_policy("razor", heads=str(path), compression=3.0, buffer=8)
    assert policy.retrieval == RETRIEVAL and policy.sinks == 4 and policy.compensate
    drive.empty_cache(tiny.model, drive.plan(tiny.model, policy, 32, 16), 1)  # matches the model

    save_heads(path, num_layers=3, num_heads=4, num_kv_heads=2, retrieval_kv_heads=[[1, 0]] * 3)
    with pytest.raises(ValueError, match=r"heads table is 3 layers x 2 KV heads, the model has 2 layers x 2"):
        drive.empty_cache(tiny.model, drive.plan(tiny.model, make_policy("razor", heads=str(path)), 32, 16), 1)
    save_heads(path, num_layers=2, num_heads=8, num_kv_heads=4, retrieval_kv_heads=[[1, 0, 0, 0]] * 2)
    with pytest.raises(ValueError, match=r"2 layers x 4 KV heads, the model has 2 layers x 2"):
        drive.empty_cache(tiny.model, drive.plan(tiny.model, make_policy("razor", heads=str(path)), 32, 16), 1)
    save_heads(path, num_layers=2, num_heads=4, num_kv_heads=2, retrieval_kv_heads=[[1, 0]])
    with pytest.raises(ValueError, match="not 2 layers x 2 KV heads as it declares"):
        make_policy("razor", heads=str(path))
    with pytest.raises(FileNotFoundError, match="missing.json"):
        make_policy("razor", heads=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="needs a heads file"):
        make_policy("razor")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(compression=0.5), r"compression \(C\)=0.5 must be >= 1"),
        (dict(buffer=0), r"buffer \(S0\)=0"),
        (dict(sinks=-1), r"sinks \(N0\)=-1"),
        (dict(fold="never"), "fold='never'"),
    ],
)
def test_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        RazorAttention(retrieval=RETRIEVAL, **kw)


def test_table_errors():
    with pytest.raises(ValueError, match="exactly one of retrieval"):
        RazorAttention()
    with pytest.raises(ValueError, match="same non-zero number of heads"):
        RazorAttention(retrieval=((True, False), (True,)))
    with pytest.raises(ValueError, match="positions must be 'absolute'"):
        CompensatedWindow(positions="rolling")


# --- ALiBi ------------------------------------------------------------------------------------------


def _alibi_model(seed=0, std=0.02, heads=8):
    cfg = tiny_config(position_embedding="alibi", num_heads=heads, num_kv_heads=heads, head_dim=8)
    model = Llama(cfg, rngs=nnx.Rngs(seed), init_std=std)
    rng = np.random.default_rng(seed)
    for layer in model.layers:  # uneven RMSNorm gains, so eq. 2's ||g||^2 and the sound bound differ
        w = layer.input_layernorm.weight
        w[...] = jnp.asarray(rng.uniform(0.5, 1.5, w[...].shape), w[...].dtype)
    return model


@pytest.mark.parametrize("bound", ["paper", "sound"])
@pytest.mark.parametrize("std", [0.02, 0.05])
def test_alibi_attention_beyond_the_scope_is_below_eps(bound, std):
    eps, t = 1e-3, 192
    model = _alibi_model(std=std)
    scopes = alibi_scopes(model, eps=eps, bound=bound)
    maps = attention_maps(model, jnp.asarray([random_ids(t, 260, seed=5)]))
    m, n = np.arange(t)[:, None], np.arange(t)[None, :]
    checked = 0
    for layer, probs in enumerate(maps):
        for h in range(probs.shape[1]):
            far = (m - n) > scopes[layer, h]
            if far.any():
                checked += 1
                assert probs[0, h][far].max() < eps, (layer, h, scopes[layer, h])
    assert checked >= 4  # some heads' scopes are shorter than the input, so the claim is tested


def test_alibi_scopes_sound_vs_paper():
    model = _alibi_model()
    paper, sound = alibi_scopes(model, bound="paper"), alibi_scopes(model, bound="sound")
    assert np.all(sound >= paper) and np.any(sound > paper)  # uneven gains: d max g^2 > ||g||^2
    slopes = attention.alibi_slopes(8)
    assert np.all(np.diff(paper[0]) > 0)  # smaller slope, wider scope
    assert paper[0, 0] > -math.log(1e-3) / slopes[0]
    with pytest.raises(ValueError, match=r"eps=1.5 must be in \(0, 1\)"):
        alibi_scopes(model, eps=1.5)
    with pytest.raises(ValueError, match="not ALiBi"):
        alibi_scopes(Llama(tiny_config(), rngs=nnx.Rngs(0)))


def test_alibi_razor_keeps_each_heads_scope():
    """Heads with scope <= S0 keep exactly their recent L_h tokens (in power-of-two groups), the
    others are kept whole; the logits stay close to the full cache's."""
    model = _alibi_model(std=0.05)
    scopes = kv_scopes(alibi_scopes(model), 8)
    buffer = 100
    data = dict(num_layers=2, num_heads=8, num_kv_heads=8, kv_scopes=scopes)
    policy = razor_from_heads(data, buffer=buffer)
    assert policy.sinks == 0 and not policy.compensate
    n, bucket = 150, 256
    ids = random_ids(n, 260, seed=9)
    prefill, _ = stepper(model, policy, bucket + 4)
    toks = np.zeros((1, bucket), np.int32)
    pos = np.full((1, bucket), -1, np.int32)
    toks[0, -n:], pos[0, -n:] = ids, np.arange(n)
    logits, cache = prefill(jnp.asarray(toks), jnp.asarray(pos))
    local = 0
    for layer, lc in enumerate(cache):
        kept = lc.positions()[0]
        for h in range(8):
            got = sorted(int(p) for p in kept[h] if p >= 0)
            if scopes[layer, h] > buffer:
                assert got == list(range(n))
            else:
                local += 1
                assert got == list(range(max(0, n - scopes[layer, h]), n)), (layer, h)
        # Local heads share arrays by power-of-two scope: few groups, each as long as its widest scope.
        for (hs, sub), g in zip(policy.head_split(layer), lc.groups):
            if isinstance(sub, CompensatedWindow):
                assert g.capacity == max(scopes[layer, h] for h in hs)
    assert local >= 4
    full_logits, full_cache = stepper(model, FullCache(), bucket + 4)[0](jnp.asarray(toks), jnp.asarray(pos))
    assert sum(c.nbytes for c in cache) < sum(c.nbytes for c in full_cache)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full_logits), atol=1e-2)


def test_retrieval_heads_keep_a_window_ring_on_a_sliding_window_model(tiny):
    """Seen before: RazorAttention inherited `on_sliding_window` as the identity, so on a sliding-window
    model (Mistral) its retrieval heads kept the whole context, which the model can no longer see.
    Now they keep a ring of the window's size: bytes of a window, and with every head a retrieval
    head the logits equal the sliding-window model's full forward."""
    import dataclasses

    w, n = 8, 30
    model = Llama(dataclasses.replace(tiny.model.cfg, sliding_window=w), rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(tiny.model, nnx.Param))
    ids = random_ids(n, 260, seed=12)
    full = np.asarray(drive.logits(model, jnp.asarray([ids])))[0]
    assert np.abs(full - np.asarray(drive.logits(tiny.model, jnp.asarray([ids])))[0]).max() > 1e-3  # the window matters

    every = RazorAttention(retrieval=((True, True), (True, True)), buffer=4, sinks=2)
    p = 12
    prefill, decode = stepper(model, every, n + 4)
    logits, cache = prefill(jnp.asarray([ids[:p]]), jnp.asarray([np.arange(p)]))
    ours = [np.asarray(logits[0])]
    for t in range(p, n):
        logits, cache = decode(jnp.asarray([ids[t]]), jnp.asarray([t]), cache)
        ours.append(np.asarray(logits[0]))
    np.testing.assert_allclose(np.stack(ours), full[p - 1:], atol=1e-5, rtol=0)
    assert [g.capacity for g in cache[0].groups] == [w]

    mixed = drive.empty_cache(model, drive.plan(model, RazorAttention(retrieval=RETRIEVAL, buffer=4, compression=8, sinks=2), 1000, 900), 1)
    for layer in mixed:
        # the retrieval ring, then the local heads' sinks + max(S0, N / C) + compensation (as without a window)
        assert [g.capacity for g in layer.groups] == [w, 2 + math.ceil(900 / 8) + 1]
        k = layer.groups[0].k
        assert layer.groups[0].nbytes == k.dtype.itemsize * k.shape[0] * k.shape[1] * w * (2 * k.shape[3] + 2)


def test_equal_bytes_budget_matches_razors_bytes_and_names_its_heads(tiny):
    """At the equal-bytes budget a StreamingLLM cache takes RazorAttention's bytes (within one slot per
    head); two head tables with the same count have different descriptions (records key on them)."""
    from kvjax.cache import nbytes
    from kvjax.drive import equal_bytes_budget
    from kvjax.policies import StreamingLLM

    razor = RazorAttention(retrieval=RETRIEVAL, buffer=16, compression=8, sinks=2)
    prompt, new = 200, 8
    budget = equal_bytes_budget(tiny.model, razor, prompt, new)
    # by hand: per layer one retrieval head of 208 slots and one local head of 2 + max(16, 25) + 1
    assert budget == (2 * (208 + 2 + 25 + 1)) // 4
    rz = nbytes(drive.empty_cache(tiny.model, drive.plan(tiny.model, razor, prompt + new, prompt), 1))
    st = nbytes(drive.empty_cache(tiny.model, drive.plan(tiny.model, StreamingLLM(budget=budget, sinks=4), prompt + new, prompt), 1))
    per_slot = st // (2 * 2 * budget)
    assert abs(rz - st) < 2 * 2 * per_slot
    other = RazorAttention(retrieval=((False, True), (True, False)), buffer=16, compression=8, sinks=2)
    assert other.describe() != razor.describe()


def test_table_1_controls_protect_no_head_or_as_many_at_random(tiny_dir, tmp_path):
    """RazorAttention Table 1: protect 0 %, random heads as many as the probe's, or the probe's."""
    import json

    from kvjax.experiments import find_heads
    from kvjax.heads import control_heads

    found = np.array([[True, False, False, True], [False, False, True, False], [False, False, False, False]])
    draws = [control_heads(found, "random", seed=s) for s in range(6)]
    # as many heads as the probe's, never one of them (the paper's random heads are a control for them)
    assert all(d.shape == found.shape and d.sum() == found.sum() and not (d & found).any() for d in draws)
    assert len({d.tobytes() for d in draws}) > 1 and np.array_equal(draws[0], control_heads(found, "random", seed=0))
    assert not control_heads(found, "none").any()
    # kvjax-small's probe table: a draw over all heads at seed 0 shared its head (4, 0); this one cannot
    probe = np.array([[0, 0], [0, 0], [0, 0], [1, 1], [1, 0], [0, 0]], bool)
    drawn = control_heads(probe, "random", seed=0)
    assert drawn.sum() == 3 and not (drawn & probe).any()
    with pytest.raises(ValueError, match="more than the 1 it did not select"):
        control_heads(np.array([[True, True, False]]), "random")
    with pytest.raises(ValueError, match="control='some'"):
        control_heads(found, "some")
    tables = {}
    for control in (None, "random", "none"):
        out = tmp_path / f"{control}.json"
        argv = ["--model", str(tiny_dir), "--out", str(out), "--k", "32", "--repeats", "3", "--induction-ratio", "0.2"]
        assert find_heads.main(argv + (["--control", control] if control else [])) == 0
        tables[control] = np.asarray(json.loads(out.read_text())["retrieval_kv_heads"])
        razor_from_heads(str(out), buffer=8)  # each file is a usable RazorAttention
    assert tables["random"].sum() == tables[None].sum() > 0 and not tables["none"].any()
    assert not (tables["random"] & tables[None]).any()


@pytest.mark.parametrize("prefill_mode", ["full", "stream"])
def test_ratio_budget_for_local_heads_per_row(sharp_dir, prefill_mode):
    """`RazorAttention(ratio=r)`: in one batch, a local head of a row of n prompt tokens holds
    max(sinks + 2, floor(n (1 - r))) slots, the compensation slot included, after the prompt and
    through decoding (the window slides, its leavers folded); retrieval heads keep everything. Each
    row equals the row run alone with the window given as S0 (that path is the reference's, above):
    kept positions, compensation token (last position, N_d, k_hat) and logits."""
    sinks, ratio, steps, bucket = 2, 0.6, 8, 64
    lengths = (40, 23)
    ids = [random_ids(n + steps, 260, seed=70 + n) for n in lengths]
    lm = load(sharp_dir)
    policy = RazorAttention(retrieval=RETRIEVAL, ratio=ratio, sinks=sinks, prefill_mode=prefill_mode)
    assert "ratio=0.6" in policy.describe() and "compression" not in policy.describe()
    prefill, decode = stepper(lm.model, policy, bucket + steps)
    toks = np.zeros((2, bucket), np.int32)
    pos = np.full((2, bucket), -1, np.int32)
    for r, n in enumerate(lengths):
        toks[r, bucket - n:], pos[r, bucket - n:] = ids[r][:n], np.arange(n)
    logits, cache = prefill(jnp.asarray(toks), jnp.asarray(pos))
    snaps, outs = [[_ours_snapshot(policy, cache, r) for r in range(2)]], [np.asarray(logits)]
    for s in range(steps):
        logits, cache = decode(jnp.asarray([ids[r][n + s] for r, n in enumerate(lengths)]),
                               jnp.asarray([n + s for n in lengths]), cache)
        snaps.append([_ours_snapshot(policy, cache, r) for r in range(2)])
        outs.append(np.asarray(logits))
    for r, n in enumerate(lengths):
        slots = int(np.floor(n * (1 - ratio)))
        window = slots - sinks - 1
        for t, snap in enumerate(snaps):
            for layer in range(2):
                for h in range(2):
                    kept, comp = snap[r][layer][h]
                    if RETRIEVAL[layer][h]:
                        assert kept == list(range(n + t))
                    else:
                        assert kept == list(range(sinks)) + list(range(n + t - window, n + t))
                        assert len(kept) + (comp is not None) == slots and comp[1] == n + t - window - sinks
        alone = RazorAttention(retrieval=RETRIEVAL, buffer=window, compression=float(n), sinks=sinks,
                               prefill_mode=prefill_mode)
        a_prefill, a_decode = stepper(lm.model, alone, bucket + steps)
        logits, a_cache = a_prefill(*left_pad(ids[r][:n], bucket))
        a_snaps, a_outs = [_ours_snapshot(alone, a_cache, 0)], [np.asarray(logits[0])]
        for s in range(steps):
            logits, a_cache = a_decode(jnp.asarray([ids[r][n + s]]), jnp.asarray([n + s]), a_cache)
            a_snaps.append(_ours_snapshot(alone, a_cache, 0))
            a_outs.append(np.asarray(logits[0]))
        for ours, theirs in zip(snaps, a_snaps):
            for (op, oc), (ap, ac) in zip(sum(ours[r], []), sum(theirs, [])):
                assert op == ap and (oc is None) == (ac is None)
                if oc is not None:
                    assert oc[:2] == ac[:2]
                    np.testing.assert_allclose(oc[2], ac[2], atol=1e-5)
        np.testing.assert_allclose(np.stack([x[r] for x in outs]), np.stack(a_outs), atol=1e-4, rtol=0)


def test_ratio_replaces_compression_and_buffer():
    with pytest.raises(ValueError, match=r"ratio=0.5 sizes the local heads instead of compression \(C\)"):
        RazorAttention(retrieval=RETRIEVAL, ratio=0.5, compression=5.0)
    with pytest.raises(ValueError, match="a ratio does not apply"):
        RazorAttention(scopes=((9000, 3), (3, 3)), ratio=0.5)
    with pytest.raises(ValueError, match="prefill_mode must be 'full' or 'stream'"):
        RazorAttention(retrieval=RETRIEVAL, ratio=0.5, prefill_mode="chunked", chunk=8)
    assert RazorAttention(retrieval=RETRIEVAL).describe() == RazorAttention(
        retrieval=RETRIEVAL, compression=5.0, buffer=4000).describe()  # the defaults, as before ratios
    assert "compression=5.0, buffer=4000" in RazorAttention(retrieval=RETRIEVAL).describe()


def test_every_suite_takes_the_models_shipped_heads_when_heads_is_not_given(tmp_path):
    """kvjax-small ships heads.json; `--policy razor` without --heads reads it in each suite alike (the
    passkey and generate commands once refused it), and only when razor is asked for."""
    import argparse

    from kvjax.experiments import passkey
    from kvjax.experiments.common import add_compare_args, add_policy_args, chosen_policies, policy_from_args
    from kvjax.experiments.ruler import __main__ as ruler_cli
    from kvjax.models.tiny import make_random_checkpoint

    model = make_random_checkpoint(tmp_path / "m", tiny_config(max_position_embeddings=512), seed=0)
    save_heads(model / "heads.json", num_layers=2, num_heads=4, num_kv_heads=2, retrieval_kv_heads=[[1, 0], [0, 1]])
    one, many = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_policy_args(one, default="full")
    add_compare_args(many, default="full")
    assert policy_from_args(one.parse_args(["--policy", "razor"]), 2, model_dir=model).retrieval == RETRIEVAL
    args = many.parse_args(["--compare", "full,streaming"])
    chosen_policies(many, args, 2, model_dir=model)
    assert args.heads is None  # no razor, no --heads: the other policies would refuse it
    _, args = ruler_cli.parse(["--policy", "razor", "--model", str(model)])
    assert list(ruler_cli.cell_policies(None, args, 2, model).values())[0].retrieval == RETRIEVAL

    out = tmp_path / "pk"
    assert passkey.main(["--model", str(model), "--policy", "razor", "--buffer", "32", "--lengths", "300",
                         "--depths", "0", "--samples", "1", "--out", str(out)]) == 0
    (record,) = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert record["policy"].startswith("RazorAttention(retrieval ") and "2/4 KV heads kept whole" in record["policy"]


@pytest.mark.parametrize("prefill_mode,chunk", [("full", None), ("stream", None), ("chunked", 1), ("chunked", 8)])
def test_local_window_is_max_s0_and_n_over_c_in_every_prefill_mode(sharp_dir, prefill_mode, chunk):
    """Algorithm 1's L = max(S0, N / C) whether the prompt is attended whole, read token by token or in
    chunks (the prompt's length is known before it is read): with S0 = 8, C = 2 and a 64-token prompt
    a local head keeps its 2 sinks and the last 32 tokens, the other 30 in the compensation slot
    (N_d = 30, its newest position 33); retrieval heads keep all 64."""
    sinks, n, bucket = 2, 64, 64
    lm = load(sharp_dir)
    policy = RazorAttention(retrieval=RETRIEVAL, buffer=8, compression=2.0, sinks=sinks, prefill_mode=prefill_mode,
                            chunk=chunk)
    prefill, _ = stepper(lm.model, policy, bucket + 4)
    _, cache = prefill(*left_pad(random_ids(n, 260, seed=81), bucket))
    snap = _ours_snapshot(policy, cache, 0)
    for layer in range(2):
        for h in range(2):
            kept, comp = snap[layer][h]
            if RETRIEVAL[layer][h]:
                assert kept == list(range(n))
            else:
                assert kept == list(range(sinks)) + list(range(n - 32, n)), (prefill_mode, kept)
                assert comp[:2] == (n - 32 - 1, n - 32 - sinks)


def test_a_comparison_applies_the_prefill_mode_to_every_policy_or_refuses(tmp_path):
    """`--compare streaming,razor --prefill-mode chunked --chunk 16` reads the prompt in chunks under both
    (RazorAttention once silently attended it whole); a policy that has no chunked mode (the gate) is
    refused by name instead of being run another way."""
    import argparse

    from kvjax.experiments.common import add_compare_args, chosen_policies

    p = argparse.ArgumentParser()
    add_compare_args(p, default="full")
    heads = tmp_path / "heads.json"
    save_heads(heads, num_layers=2, num_heads=4, num_kv_heads=2, retrieval_kv_heads=[[1, 0], [0, 1]])
    args = p.parse_args(["--compare", "streaming,razor", "--prefill-mode", "chunked", "--chunk", "16",
                         "--heads", str(heads), "--budget", "64"])
    _, (streaming, razor) = chosen_policies(p, args, 2)
    assert streaming.prefill_mode == razor.prefill_mode == "chunked" and razor.chunk == 16
    assert "prefill_mode='chunked', chunk=16" in razor.describe()
    args = p.parse_args(["--compare", "streaming,gate", "--prefill-mode", "chunked", "--chunk", "16"])
    with pytest.raises(InvalidInput, match=r"--prefill-mode chunked applies to every policy compared, and gate "
                                           r"cannot take it"):
        chosen_policies(p, args, 2)


def test_table_1_preset_keeps_only_the_recent_s0_tokens_in_the_other_heads(sharp_dir, tmp_path):
    """`--policy razor-table1` is RazorAttention's Table 1 protocol ("only the recent 4K tokens in the rest"
    of the heads): a non-retrieval head keeps exactly the last S0 tokens, with no sinks and no
    compensation slot, whatever N / C would give; retrieval heads keep everything."""
    from kvjax.policies import make_policy

    heads = tmp_path / "heads.json"
    save_heads(heads, num_layers=2, num_heads=4, num_kv_heads=2, retrieval_kv_heads=[list(r) for r in RETRIEVAL])
    policy = make_policy("razor-table1", heads=str(heads), buffer=16)
    assert policy.sinks == 0 and not policy.compensate
    n, bucket = 60, 64
    prefill, _ = stepper(load(sharp_dir).model, policy, bucket + 4)
    _, cache = prefill(*left_pad(random_ids(n, 260, seed=83), bucket))
    snap = _ours_snapshot(policy, cache, 0)
    for layer in range(2):
        for h in range(2):
            kept, comp = snap[layer][h]
            assert comp is None
            assert kept == (list(range(n)) if RETRIEVAL[layer][h] else list(range(n - 16, n)))


@pytest.mark.parametrize("control", ["none", "random"])
def test_table_1_controls_decide_the_protected_heads_of_an_alibi_model(control, tmp_path):
    """An ALiBi heads file carries each head's vision scope, which alone decided which heads Razor keeps
    whole, so a Table 1 control changed nothing. With a control, its heads are kept whole and every
    other head keeps its scope capped at S0."""
    from kvjax.experiments import find_heads

    from kvjax.models.loading import LoadedModel

    model = _alibi_model(std=0.05)
    lm = LoadedModel(model=model, tokenizer=None, config=model.cfg, path=tmp_path)
    out = tmp_path / f"{control}.json"
    find_heads.find(lm, out, k=32, repeats=3, induction_ratio=0.5, control=control)
    data = json.loads(out.read_text())
    assert "kv_scopes" in data
    protected = np.asarray(data["retrieval_kv_heads"], bool)
    policy = razor_from_heads(str(out), buffer=8)
    whole = np.array([[policy.is_retrieval(i, h) for h in range(protected.shape[1])]
                      for i in range(protected.shape[0])])
    np.testing.assert_array_equal(whole, protected)
    assert (control == "none") == (not whole.any())
    assert max(s for r, p in zip(policy.scopes, protected) for s, k in zip(r, p) if not k) <= 8


@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.slow), 8])
def test_a_left_padded_prompt_read_in_chunks_keeps_max_s0_and_n_over_c(sharp_dir, chunk):
    """A 50-token prompt padded to 64, read in chunks (the padding first): a local head keeps its 2 sinks and the
    last max(8, 50 / 2) = 25 tokens, as a whole prompt does; padding-only chunks once reset the window to S0, so
    it kept 8. Through the model's scan and through `engine.chunks` (the host loop `generate` runs),
    which once skipped `size_rows` and kept S0 for every prompt."""
    from kvjax import engine

    sinks, n, bucket = 2, 50, 64
    lm = load(sharp_dir)
    policy = RazorAttention(retrieval=RETRIEVAL, buffer=8, compression=2.0, sinks=sinks, prefill_mode="chunked",
                            chunk=chunk)
    tokens, positions = left_pad(random_ids(n, 260, seed=82), bucket)
    plan = drive.plan(lm.model, policy, bucket + 4, bucket)
    scan = engine.prefill(lm.model, tokens, positions, plan=plan)[1]
    loop = engine.chunks(lm.model, tokens, positions, plan)[1]
    for cache in (scan, loop):
        snap = _ours_snapshot(policy, cache, 0)
        for layer in range(2):
            for h in range(2):
                kept, comp = snap[layer][h]
                want = list(range(n)) if RETRIEVAL[layer][h] else list(range(sinks)) + list(range(n - 25, n))
                assert kept == want, (layer, h, kept)
