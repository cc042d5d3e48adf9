"""Generation: greedy correctness, batching, EOS, sampling, compile count, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import FullCache, Sampling, StreamingLLM, generate
from kvjax.policies import H2O, KNorm, SnapKV
from kvjax.generate import bucket_length, pad_left, truncate_middle
from tests.conftest import compile_log, random_ids
from kvjax import drive


def greedy_reference(model, ids, n):
    """Greedy continuation by re-running the full forward pass for every token.

    The sequence is right padded to one length: causal attention makes the padding
    invisible to earlier positions, and the forward compiles once.
    """
    from flax import nnx

    forward = nnx.jit(lambda m, x: drive.logits(m, x))
    ids = list(ids)
    total = len(ids) + n
    for _ in range(n):
        x = jnp.asarray([ids + [0] * (total - len(ids))])
        ids.append(int(np.argmax(np.asarray(forward(model, x))[0, len(ids) - 1])))
    return ids[-n:]


def test_greedy_full_cache_matches_full_forward(tiny):
    ids = random_ids(23, 260, seed=10)
    g = generate(tiny.model, [ids], FullCache(), max_new_tokens=12, eos_ids=())
    assert g.tokens[0].tolist() == greedy_reference(tiny.model, ids, 12)
    assert g.lengths.tolist() == [12] and g.decode_steps == 11


@pytest.mark.parametrize("policy", [FullCache(), StreamingLLM(budget=12, sinks=2)])
def test_batch_with_left_padding_equals_one_by_one(tiny, policy):
    prompts = [random_ids(n, 260, seed=s) for n, s in [(30, 11), (9, 12), (17, 13)]]
    batch = generate(tiny.model, prompts, policy, max_new_tokens=15, eos_ids=())
    for row, p in zip(batch.tokens, prompts):
        alone = generate(tiny.model, [p], policy, max_new_tokens=15, eos_ids=())
        assert row.tolist() == alone.tokens[0].tolist()


def test_eos_stops_rows_and_the_loop(tiny):
    ids = random_ids(20, 260, seed=14)
    free = generate(tiny.model, [ids], FullCache(), max_new_tokens=20, eos_ids=()).tokens[0]
    eos = int(free[3])
    first = int(np.argmax(free == eos))  # the first occurrence may come before index 3
    g = generate(tiny.model, [ids], FullCache(), max_new_tokens=20, eos_ids=(eos,), pad_id=0)
    assert g.lengths.tolist() == [first + 1]
    assert g.tokens[0, : first + 1].tolist() == free[: first + 1].tolist()
    assert (g.tokens[0, first + 1 :] == 0).all()
    assert g.decode_steps == first  # the while_loop stopped when every row was done


def test_sampling(tiny):
    ids = random_ids(20, 260, seed=15)
    hot = Sampling(temperature=1.0)
    a = generate(tiny.model, [ids], FullCache(), max_new_tokens=10, sampling=hot, key=jax.random.key(1), eos_ids=())
    b = generate(tiny.model, [ids], FullCache(), max_new_tokens=10, sampling=hot, key=jax.random.key(1), eos_ids=())
    c = generate(tiny.model, [ids], FullCache(), max_new_tokens=10, sampling=hot, key=jax.random.key(2), eos_ids=())
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.tokens.tolist() != c.tokens.tolist()  # a random model is near uniform over 260 tokens
    greedy = generate(tiny.model, [ids], FullCache(), max_new_tokens=10, eos_ids=())
    nucleus = generate(
        tiny.model, [ids], FullCache(), max_new_tokens=10, sampling=Sampling(1.0, top_p=1e-6), key=jax.random.key(3), eos_ids=()
    )
    assert nucleus.tokens.tolist() == greedy.tokens.tolist()  # top_p -> 0 keeps only the argmax


def test_top_p_keeps_the_smallest_nucleus():
    from kvjax.generate import sample

    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    draws = jax.vmap(lambda k: sample(logits, k, Sampling(1.0, top_p=0.75)))(jax.random.split(jax.random.key(0), 2000))
    assert set(np.unique(np.asarray(draws)).tolist()) == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3


def test_decode_compiles_once_per_bucket(tiny):
    """Two prompt lengths in one bucket, >= 20 decode steps each: the second compiles nothing (jax's
    compile events, not a private cache size)."""
    policy = StreamingLLM(budget=16, sinks=4)
    assert bucket_length(40) == bucket_length(57) == 64
    with compile_log() as first:
        g1 = generate(tiny.model, [random_ids(40, 260, seed=16)], policy, max_new_tokens=24, eos_ids=())
    with compile_log() as second:
        g2 = generate(tiny.model, [random_ids(57, 260, seed=17)], policy, max_new_tokens=24, eos_ids=())
    assert g1.decode_steps == g2.decode_steps == 23
    assert len(first) >= 2 and second == []  # prefill and decode loop once, for both lengths


def test_prompt_too_long_is_an_error_unless_truncated(tiny):
    limit = tiny.config.max_position_embeddings  # 4096
    ids = random_ids(limit - 10, 260, seed=18)
    with pytest.raises(ValueError, match=rf"prompt of {limit - 10} tokens \+ max_new_tokens=20 exceeds .*max_position_embeddings={limit}"):
        generate(tiny.model, [ids], StreamingLLM(budget=32), max_new_tokens=20)
    g = generate(tiny.model, [ids], StreamingLLM(budget=32), max_new_tokens=20, truncate=True, eos_ids=())
    assert g.prompt_bucket == 4096 and g.lengths.tolist() == [20]
    # Rolling positions never exceed the cache size while decoding: only the prompt must fit.
    g = generate(tiny.model, [ids], StreamingLLM(budget=32, positions="rolling"), max_new_tokens=20, eos_ids=())
    assert g.lengths.tolist() == [20]


def test_truncate_middle():
    assert truncate_middle(list(range(10)), 4) == [0, 1, 8, 9]
    assert truncate_middle(list(range(10)), 5) == [0, 1, 7, 8, 9]
    assert truncate_middle([1, 2], 5) == [1, 2]


def test_bad_inputs(tiny):
    with pytest.raises(ValueError, match="token id 999 is outside the vocabulary"):
        generate(tiny.model, [[5, 999]], FullCache())
    with pytest.raises(ValueError, match="at least one token"):
        generate(tiny.model, [[]], FullCache())
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        generate(tiny.model, [[5]], FullCache(), max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature=-1"):
        Sampling(temperature=-1)


def test_no_recompile_for_max_new_tokens_in_a_bucket_eos_ids_or_pad_id(tiny):
    """Seen before: max_new_tokens 16 -> 17 recompiled prefill and decode (7-8 s each on a 16-layer
    model), and so did LongBench's extra newline stop. Now they are arrays; the token buffer is
    bucketed (17..32 share one), EOS ids padded."""
    policy = StreamingLLM(budget=16, sinks=4)
    prompt = random_ids(30, 260, seed=40)
    generate(tiny.model, [prompt], policy, max_new_tokens=17, eos_ids=(2,))
    with compile_log() as log:
        a = generate(tiny.model, [prompt], policy, max_new_tokens=30, eos_ids=())
        b = generate(tiny.model, [prompt], policy, max_new_tokens=23, eos_ids=(2, 10), pad_id=5)
        c = generate(tiny.model, [prompt], policy, max_new_tokens=17, eos_ids=(), pad_id=0)
    assert log == []
    assert a.tokens.shape == (1, 30) and b.tokens.shape == (1, 23) and c.tokens.shape == (1, 17)
    np.testing.assert_array_equal(a.tokens[:, :17], c.tokens)  # the same greedy tokens, whatever the buffer
    with compile_log() as log:
        generate(tiny.model, [prompt], policy, max_new_tokens=33, eos_ids=(2,))  # the next bucket
    # decode (its buffer), once; prefill is keyed by its sized plan, and StreamingLLM's 16 slots do not grow
    # with the room for new tokens (before the plan was the key, max_len was, and this was 2)
    assert len(log) == 1


def test_eos_given_as_array_still_stops(tiny):
    prompt = random_ids(20, 260, seed=41)
    free = generate(tiny.model, [prompt], FullCache(), max_new_tokens=12, eos_ids=())
    stop = free.sequences()[0][4]
    out = generate(tiny.model, [prompt], FullCache(), max_new_tokens=12, eos_ids=(999_999, stop))
    assert out.sequences()[0] == free.sequences()[0][: free.sequences()[0].index(stop) + 1]


def test_prefill_compiles_once_per_plan_not_per_max_len(tiny):
    """The compiled prefill's key is the sized plan: a budget policy's slot counts are the same for any
    room after the prompt (one compilation), the full cache's grow with it (one per size)."""
    from kvjax import engine

    model = tiny.model
    tokens, positions = pad_left([random_ids(30, 260, seed=42)], 32, 0)
    ring = StreamingLLM(budget=16, sinks=4)
    assert drive.plan(model, ring, 64, 32) == drive.plan(model, ring, 96, 32)  # 16 slots in every layer either way
    assert drive.plan(model, FullCache(), 64, 32) != drive.plan(model, FullCache(), 96, 32)
    assert [lp.sizes for lp in drive.plan(model, FullCache(), 96, 32).layers] == [(96,)] * tiny.config.num_layers
    with compile_log() as ring_log:
        for max_len in (64, 96, 160):
            engine.prefill(model, tokens, positions, plan=drive.plan(model, ring, max_len, 32))
    with compile_log() as full_log:
        for max_len in (64, 96, 96):
            engine.prefill(model, tokens, positions, plan=drive.plan(model, FullCache(), max_len, 32))
    assert len(ring_log) == 1 and len(full_log) == 2


def test_pad_rows_runs_a_short_batch_as_a_full_one(sharp_dir):
    """`generate_many(pad_rows=3)` with two rows: the programs compiled for three rows serve it (nothing compiles),
    and each row's tokens, held bytes and kept positions are those of the two rows run alone."""
    from kvjax import generate_many, kept_positions
    from kvjax.errors import InvalidInput
    from kvjax.policies import SnapKV
    from kvjax.models import load

    model = load(sharp_dir).model
    policies = [SnapKV(budget=12, observation_window=4, kernel=3), StreamingLLM(budget=12, sinks=2)]
    prompts = [random_ids(30 + i, 260, seed=70 + i) for i in range(3)]
    questions = [random_ids(4 + i, 260, seed=80 + i) for i in range(3)]
    generate_many(model, prompts, policies, max_new_tokens=5, questions=questions, pad_rows=3, keep_caches=False)
    with compile_log() as compiles:  # as the suites call it (kept caches would be sliced to the real rows)
        generate_many(model, prompts[:2], policies, max_new_tokens=5, questions=questions[:2], pad_rows=3,
                      keep_caches=False)
    assert compiles == []
    short = generate_many(model, prompts[:2], policies, max_new_tokens=5, questions=questions[:2], pad_rows=3)
    alone = generate_many(model, prompts[:2], policies, max_new_tokens=5, questions=questions[:2])
    for s, a in zip(short, alone):
        assert s.tokens.tolist() == a.tokens.tolist() and s.lengths.tolist() == a.lengths.tolist()
        np.testing.assert_array_equal(s.held_bytes, a.held_bytes)
        for x, y in zip(kept_positions(s.cache), kept_positions(a.cache)):
            np.testing.assert_array_equal(x, y)
    with pytest.raises(InvalidInput, match="pad_rows pads prompt rows"):
        generate_many(model, prompts[:1], policies, max_new_tokens=5, questions=questions, pad_rows=3)


def test_shared_groups_are_the_fewest_passes_of_nearly_equal_size():
    """The report's 25 RULER plans at 8 a pass: four passes of 7, 6, 6 and 6 plans (not 8, 8, 8 and 1), in order;
    a lone plan prefills alone."""
    from kvjax.generate import shared_groups

    r = lambda a, b: tuple(range(a, b))  # noqa: E731
    assert shared_groups(list(range(25)), 8) == [r(0, 7), r(7, 13), r(13, 19), r(19, 25)]
    assert shared_groups(list(range(16)), 8) == [r(0, 8), r(8, 16)]
    assert shared_groups([0, 2, 5, 6, 9], 2) == [(0, 2), (5, 6), (9,)]
    assert shared_groups([2, 7], 8) == [(2, 7)]
    assert shared_groups([3], 8) == [] and shared_groups([], 8) == []


def test_generate_many_shares_one_prompt_pass_and_equals_one_call_per_policy(sharp_dir, monkeypatch):
    """`generate_many`: prompt compressors, rings and H2O share one pass over the prompts (one compiled
    program for the tuple of plans), MAT's stream prefill runs alone, and every policy's tokens and kept
    positions equal those of its own `generate` call, with questions (the agnostic protocol) and without."""
    import importlib

    from kvjax import generate_many, kept_positions
    from kvjax.policies import H2O, TOVA, PyramidKV, SnapKV, mat
    from kvjax.models import load

    generate_module = importlib.import_module("kvjax.generate")
    model = load(sharp_dir).model
    # MAT (read alone) between shared ones: each group's pass runs at its first policy's turn, results in order
    policies = [FullCache(), StreamingLLM(budget=12, sinks=2), mat(12, 4, shallow_layers=1, sinks=2),
                SnapKV(budget=12, observation_window=4, kernel=3),
                PyramidKV(budget=12, observation_window=4, kernel=3, num_layers=2, beta=1), TOVA(budget=12),
                H2O(budget=12, recent=4)]
    prompts = [random_ids(40, 260, seed=60), random_ids(29, 260, seed=61)]
    questions = [random_ids(5, 260, seed=62), random_ids(7, 260, seed=63)]
    for qs, per_pass in ((None, 8), (questions, 8), (questions, 2)):  # one pass of 6 plans; three of 2
        monkeypatch.setattr(generate_module, "SHARED_PASS_PLANS", per_pass)
        many = generate_many(model, prompts, policies, max_new_tokens=6, questions=qs)
        for policy, got in zip(policies, many):
            alone = generate(model, prompts, policy, max_new_tokens=6, questions=qs)
            assert got.tokens.tolist() == alone.tokens.tolist(), policy.describe()
            for a, b in zip(kept_positions(got.cache), kept_positions(alone.cache)):
                np.testing.assert_array_equal(a, b)
        light = generate_many(model, prompts, policies, max_new_tokens=6, questions=qs, keep_caches=False)
        assert [g.tokens.tolist() for g in light] == [g.tokens.tolist() for g in many]
        assert all(g.cache is None and g.held_bytes is not None for g in light)
    # one shared program, keyed by the tuple of sized plans: new prompts of the same bucket compile nothing
    with compile_log() as compiles:
        generate_many(model, [random_ids(38, 260, seed=64), random_ids(33, 260, seed=65)], policies,
                      max_new_tokens=6, questions=questions)
    assert compiles == []


class _Counting:
    """A model that counts the forward steps it runs (a host callback, so the count is of steps run, not traced)."""

    def __init__(self, model, seen):
        self.model, self.cfg, self.seen = model, model.cfg, seen

    def __call__(self, tokens, positions, carry, step):
        jax.debug.callback(lambda: self.seen.append(1))
        return self.model(tokens, positions, carry, step)


@pytest.mark.parametrize("policy", [
    FullCache(),
    StreamingLLM(budget=20, sinks=2),
    H2O(budget=20, recent=4),
    SnapKV(budget=20, observation_window=4, kernel=3),
    KNorm(budget=20),
], ids=lambda p: type(p).__name__)
def test_a_question_runs_from_its_first_real_step(tiny, policy):
    """`drive.stream`'s last-logits path (a question extending a compressed context, `generate.question_fn`) skips the
    leading steps where every row is padding: the same last logits and cache as the scan over every step of the
    bucket (whose padding steps are no-ops), with only the longest row's steps run (5 and 3 tokens in a bucket of
    8: 5 steps)."""
    from kvjax.cache import kept_positions

    model = tiny.model
    prompts = [random_ids(26, 260, seed=91), random_ids(19, 260, seed=92)]
    tokens, positions = pad_left(prompts, 32, 0)
    plan = drive.plan(model, policy, 48, 32)
    _, cache = jax.jit(lambda t, p: drive.prompt(model, t, p, plan))(tokens, positions)
    q, q_pos = pad_left([random_ids(5, 260, seed=93), random_ids(3, 260, seed=94)], 8, 0)
    q_pos = np.where(q_pos >= 0, q_pos + np.asarray([[26], [19]]), -1).astype(np.int32)
    every, c_every = jax.jit(lambda c: drive.stream(model, q, q_pos, c, plan))(cache)
    seen = []
    last, c_last = jax.jit(lambda c: drive.stream(_Counting(model, seen), q, q_pos, c, plan, all_logits=False))(cache)
    jax.effects_barrier()
    assert len(seen) == 5
    np.testing.assert_array_equal(np.asarray(last), np.asarray(every)[:, -1])
    for a, b in zip(kept_positions(c_last), kept_positions(c_every)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(c_last), jax.tree.leaves(c_every)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _appending_policies():
    from kvjax.policies import KVzip, ExpectedAttention, KeyDiff, PyramidKV, SlimKV, TOVA, by_head

    return [
        FullCache(),
        SnapKV(budget=20, observation_window=4, kernel=3),
        SnapKV(ratio=0.5, observation_window=4, kernel=3),
        PyramidKV(budget=20, observation_window=4, kernel=3, num_layers=2, beta=1),
        SlimKV(budget=20, observation_window=4, kernel=3),
        TOVA(budget=20),
        KNorm(budget=20),
        ExpectedAttention(ratio=0.5, future=16, sinks=2),
        KeyDiff(budget=20),
        KVzip(ratio=0.5, sinks=2, repeat_ids=(1,), continue_ids=(2,), suffix_ids=(3,)),
        by_head([[True, False], [False, True]], FullCache(), SnapKV(budget=20, observation_window=4, kernel=3)),
    ]


@pytest.mark.parametrize("policy", _appending_policies(), ids=lambda p: type(p).__name__)
def test_a_question_read_as_one_chunk_equals_it_read_token_by_token(sharp_dir, policy):
    """A question after a compressed prompt, under a plan whose decoding only appends (SnapKV & co, KVzip, FullCache,
    a head split of them): `drive.follow` reads it in one forward (`kvjax.step.Append`), and its last logits and its
    cache (kept positions, keys, values) are those of `drive.stream` feeding it one token at a time, the decode path,
    for left-padded questions of different lengths (the rows' padding written nowhere)."""
    from kvjax.cache import kept_positions
    from kvjax.models import load

    model = load(sharp_dir).model
    prompts = [random_ids(37, 260, seed=95), random_ids(22, 260, seed=96)]
    tokens, positions = pad_left(prompts, 64, 0)
    plan = drive.plan(model, policy, 64 + 16 + 8, 64)
    assert plan.decode_appends
    _, cache = jax.jit(lambda t, p: drive.prompt(model, t, p, plan))(tokens, positions)
    q, q_pos = pad_left([random_ids(11, 260, seed=97), random_ids(6, 260, seed=98)], 16, 0)
    q_pos = np.where(q_pos >= 0, q_pos + np.asarray([[37], [22]]), -1).astype(np.int32)
    ref, c_ref = jax.jit(lambda c: drive.stream(model, q, q_pos, c, plan, all_logits=False))(cache)
    seen = []
    got, c_got = jax.jit(lambda c: drive.follow(_Counting(model, seen), q, q_pos, c, plan))(cache)
    jax.effects_barrier()
    assert len(seen) == 1  # one forward
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-4)
    for a, b in zip(kept_positions(c_got), kept_positions(c_ref)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(c_got), jax.tree.leaves(c_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", [
    StreamingLLM(budget=20, sinks=2),
    H2O(budget=20, recent=4),
], ids=lambda p: type(p).__name__)
def test_a_question_under_a_plan_that_evicts_or_observes_while_decoding_is_read_token_by_token(tiny, policy):
    """A ring (its window moves with every token) and H2O (each token's attention moves its scores) do more than
    append while decoding: `drive.follow` feeds their question one token at a time, and an `Append` step is refused."""
    from kvjax import step as steps
    from kvjax.errors import InvalidInput

    model = tiny.model
    plan = drive.plan(model, policy, 48, 32)
    assert not plan.decode_appends
    tokens, positions = pad_left([random_ids(26, 260, seed=91)], 32, 0)
    _, cache = jax.jit(lambda t, p: drive.prompt(model, t, p, plan))(tokens, positions)
    q, q_pos = pad_left([random_ids(5, 260, seed=93)], 8, 0)
    q_pos = np.where(q_pos >= 0, q_pos + 26, -1).astype(np.int32)
    seen = []
    jax.jit(lambda c: drive.follow(_Counting(model, seen), q, q_pos, c, plan))(cache)[0].block_until_ready()
    jax.effects_barrier()
    assert len(seen) == 5  # a step per token
    with pytest.raises(InvalidInput, match="does more than append while decoding"):
        steps.Append(plan)
