"""AnLLM: the eq. 4 mask, anchor-based inference (REDUCTION) equal to a masked full forward."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.anllm_anchors import anchor_mask, dense_mask, split_sentences, with_ac
from kvjax.policies.anllm import AnchorReduction
from tests.conftest import random_ids, stepper
from kvjax import drive
from kvjax.step import Forward

ANCHOR = 10


def eq4_reference(flags):
    """Eq. 4 transcribed: token i of sequence k; 0 if neither is an anchor and w_j is in S_<=k-1;
    0 if w_i is an anchor and w_j in S_<=k-1; else causal."""
    seq, k = [], 0
    for a in flags:
        seq.append(k)
        k += bool(a)
    n = len(flags)
    m = np.zeros((n, n), bool)
    for i in range(n):
        for j in range(n):
            earlier = seq[j] <= seq[i] - 1
            if not flags[i] and not flags[j] and earlier:
                m[i, j] = False
            elif flags[i] and earlier:
                m[i, j] = False
            else:
                m[i, j] = i >= j
    return m


LAYOUTS = {
    "random": None,
    "anchor_first": [1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0],
    "adjacent": [0, 0, 1, 1, 1, 0, 0, 1, 0, 0, 1, 1],
    "none": [0] * 12,
    "ends_without_anchor": [0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0],
    "ends_with_anchor": [0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mask_equals_eq4(layout):
    rng = np.random.default_rng(0)
    rows = [LAYOUTS[layout]] if LAYOUTS[layout] else [list(rng.random(40) < p) for p in (0.1, 0.3, 0.6)]
    for flags in rows:
        ours = np.asarray(dense_mask(anchor_mask(jnp.asarray([flags], bool))))[0]
        np.testing.assert_array_equal(ours, eq4_reference(flags))


def _with_anchors(n, seed, every=(3, 9)):
    rng = np.random.default_rng(seed)
    ids = random_ids(n, 260, seed=seed, low=11)
    pos = 0
    while True:
        pos += int(rng.integers(*every))
        if pos >= n:
            return ids
        ids[pos] = ANCHOR


@pytest.mark.parametrize("prompt_len", [23, 30])
def test_reduction_equals_masked_full_forward(tiny, prompt_len):
    """Prefill (eq. 4) + REDUCTION + decoding with generated anchors gives the logits of one full
    forward under the eq. 4 mask: the cache only drops what the mask already hides."""
    n, bucket = 60, 32
    ids = _with_anchors(n, seed=prompt_len)
    flags = jnp.asarray([[t == ANCHOR for t in ids]])
    full = np.asarray(drive.logits(tiny.model, jnp.asarray([ids]), anchors=anchor_mask(flags)))[0]
    plain = np.asarray(drive.logits(tiny.model, jnp.asarray([ids])))[0]
    assert np.abs(full - plain)[prompt_len:].max() > 1e-3  # the mask really changes the logits

    policy = AnchorReduction(anchor_ids=(ANCHOR,), anchor_slots=16, sequence=12)
    prefill, decode = stepper(tiny.model, policy, bucket + n)
    toks = np.zeros((1, bucket), np.int32)
    pos = np.full((1, bucket), -1, np.int32)
    toks[0, -prompt_len:], pos[0, -prompt_len:] = ids[:prompt_len], np.arange(prompt_len)
    logits, cache = prefill(jnp.asarray(toks), jnp.asarray(pos))
    ours = [np.asarray(logits[0])]
    sizes = []
    for t in range(prompt_len, n):
        logits, cache = decode(jnp.asarray([ids[t]]), jnp.asarray([t]), cache)
        ours.append(np.asarray(logits[0]))
        held = sorted(int(p) for p in np.asarray(cache[0].pos[0, 0]) if p >= 0)
        last = max([i for i in range(t + 1) if ids[i] == ANCHOR], default=-1)
        expect = [i for i in range(t + 1) if ids[i] == ANCHOR or i > last]
        assert held == expect, t  # REDUCTION: every anchor + the tokens after the last one
        sizes.append(len(held))
    np.testing.assert_allclose(np.stack(ours), full[prompt_len - 1 :], atol=1e-5, rtol=0)
    assert max(sizes) < n // 2


def test_keep_span_is_visible_and_kept(tiny):
    n, span = 40, (2, 9)
    ids = _with_anchors(n, seed=3)
    flags = jnp.asarray([[t == ANCHOR for t in ids]])
    keep = jnp.asarray([[span[0] <= i < span[1] for i in range(n)]])
    full = np.asarray(drive.logits(tiny.model, jnp.asarray([ids]), anchors=anchor_mask(flags, keep=keep)))[0]
    policy = AnchorReduction(anchor_ids=(ANCHOR,), anchor_slots=16, sequence=12, span=span)
    prefill, decode = stepper(tiny.model, policy, 64)
    p = 20
    logits, cache = prefill(jnp.asarray([ids[:p]]), jnp.asarray([np.arange(p)]))
    ours = [np.asarray(logits[0])]
    for t in range(p, n):
        logits, cache = decode(jnp.asarray([ids[t]]), jnp.asarray([t]), cache)
        ours.append(np.asarray(logits[0]))
    np.testing.assert_allclose(np.stack(ours), full[p - 1 :], atol=1e-5, rtol=0)
    held = set(int(x) for x in np.asarray(cache[0].pos[0, 0]) if x >= 0)
    assert set(range(*span)) <= held


def test_sentences_and_ac():
    text = "One sentence. Another one! A question? Trailing"
    assert split_sentences(text) == ["One sentence.", " Another one!", " A question?", " Trailing"]
    assert with_ac(text) == "One sentence.<AC> Another one!<AC> A question?<AC> Trailing<AC>"


def test_fact_task_with_absent_distractors_holds_only_the_answer(capsys):
    """`--distractors absent` (the task SmolLM2-135M's full attention does): of each item's options only the
    answer is a demonstration's number, and it is the asked name's; the answer's place varies; the
    default task (other demonstrations' numbers) is unchanged by the option."""
    from kvjax.experiments import eval_anllm

    demos, items = eval_anllm.fact_task(40, 5, 4, 0, "absent")
    code = {d.split()[3]: d.split()[5].rstrip(".") for d in demos}
    for it in items:
        numbers = [o.strip() for o in it["options"]]
        assert [n in code.values() for n in numbers] == [i == it["answer"] for i in range(4)]
        assert numbers[it["answer"]] == code[it["query"].split()[3]] and len(set(numbers)) == 4
    assert {it["answer"] for it in items} == {0, 1, 2, 3}
    assert eval_anllm.fact_task(6, 5, 4, 0, "demos") == eval_anllm.fact_task(6, 5, 4, 0)
    demos_1, items_1 = eval_anllm.fact_task(3, 1, 4, 0, "absent")  # one fact, three numbers never read
    assert len(demos_1) == 1 and all(len(it["options"]) == 4 for it in items_1)
    with pytest.raises(ValueError, match=r"options \(5\) <= shots \(4\)"):
        eval_anllm.fact_task(3, 4, 5, 0)
    with pytest.raises(SystemExit):  # the built-in task's option, refused with items of one's own
        eval_anllm.main(["--model", "m", "--out", "o", "--data", "items.jsonl", "--distractors", "absent"])
    assert "--distractors absent shapes the built-in task" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # so do --items, --shots and --options, which the items would silently ignore
        eval_anllm.main(["--model", "m", "--out", "o", "--data", "items.jsonl", "--items", "7", "--options", "3"])
    assert "--items 7 --options 3 shape the built-in task; --data items.jsonl brings" in capsys.readouterr().err


def test_errors():
    with pytest.raises(ValueError, match="anchor_ids is empty"):
        AnchorReduction(anchor_ids=())
    with pytest.raises(ValueError, match=r"span=\(5, 5\)"):
        AnchorReduction(anchor_ids=(1,), span=(5, 5))


@pytest.mark.parametrize("variant", ["ep", "ac"])
def test_train_anllm_cli_writes_a_loadable_model(tiny_dir, tmp_path, variant):
    import json

    from kvjax.experiments import train_anllm
    from kvjax.models import load

    data = tmp_path / "d.txt"
    data.write_text("The cache holds keys. Anchors compress a sentence! Is it enough? Yes. " * 20)
    out = tmp_path / "out"
    argv = ["--model", str(tiny_dir), "--variant", variant, "--out", str(out), "--data", str(data),
            "--steps", "2", "--seq-len", "64", "--batch", "2", "--warmup", "1", "--lr", "1e-3"]
    assert train_anllm.main(argv) == 0
    lm = load(out)
    meta = json.loads((out / "config.json").read_text())["kvjax_anllm"]
    if variant == "ac":
        ac = lm.tokenizer.convert_tokens_to_ids("<AC>")
        assert meta["anchor_ids"] == [ac] and lm.config.vocab_size == 261
        assert lm.tokenizer("a.<AC>b", add_special_tokens=False)["input_ids"].count(ac) == 1
    else:
        # The id that ends the training text's sentences.
        assert meta["anchor_ids"] == lm.tokenizer("The cache holds keys.", add_special_tokens=False)["input_ids"][-1:]
    assert (out / "training" / "loss.png").is_file()

    # The paper's metrics on the trained directory; the anchors come from its config.json.
    from kvjax.experiments import eval_anllm

    ev = tmp_path / "eval"
    eval_argv = ["--model", str(out), "--out", str(ev), "--items", "6", "--time-items", "2"]
    assert eval_anllm.main(eval_argv) == 0
    res = json.loads((ev / "results.json").read_text())
    demos, _ = eval_anllm.fact_task(6, 5, 4, 0)
    ids = []
    for d in demos:  # the demonstrations as the script tokenises them
        ids += lm.tokenizer((" " if ids else "") + d + ("<AC>" if variant == "ac" else ""),
                            add_special_tokens=False)["input_ids"]
    assert res["variant"] == variant and res["L_d"] == len(ids)
    assert res["L_kv"] == 5  # five demonstrations, each ending with its anchor: only the anchors stay
    assert res["C_down"] == pytest.approx(1 - 5 / len(ids))
    assert res["T_up"] > 0 and res["T_up_vs_full_caching"] > 0 and (ev / "results.png").is_file()
    lines = (ev / "items.jsonl").read_text().splitlines()
    assert res["acc_ansan"] == np.mean([np.argmax(json.loads(x)["ansan"]) == json.loads(x)["answer"] for x in lines])
    (ev / "items.jsonl").write_text("\n".join(lines[:3]) + "\n")  # a crash after 3 items
    assert eval_anllm.main(eval_argv[:-2] + ["--time-items", "0"]) == 0
    resumed = (ev / "items.jsonl").read_text().splitlines()
    assert len(resumed) == 6 and resumed[:3] == lines[:3]
    for a, b in zip(resumed[3:], lines[3:]):
        np.testing.assert_allclose(json.loads(a)["ansan"], json.loads(b)["ansan"], atol=1e-5)


def test_ac_embedding_init(tiny):
    from kvjax.models.vocab import add_ac_token
    from kvjax.models import load

    lm = load(tiny.path)
    emb = np.asarray(lm.model.embed_tokens.embedding[...])
    model, tok, ac = add_ac_token(lm.model, lm.tokenizer, init="mean")
    np.testing.assert_allclose(np.asarray(model.embed_tokens.embedding[...])[ac], emb.mean(0), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(model.embed_tokens.embedding[...])[: emb.shape[0]], emb)
    lm2 = load(tiny.path)
    model2, _, ac2 = add_ac_token(lm2.model, lm2.tokenizer, init="period")
    period = lm2.tokenizer(".", add_special_tokens=False)["input_ids"][0]
    np.testing.assert_array_equal(np.asarray(model2.embed_tokens.embedding[...])[ac2], emb[period])


def metaspace_tokenizer():
    """A Llama-2-style tokenizer built here: Metaspace marks word starts with "▁" (on the first piece
    only) and punctuation is split off, so a bare "." is "▁." while "blue." ends with "."."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "▁.", ".", "▁The", "▁sky", "▁is", "▁blue", "▁It", "▁ends", "▁here", "▁word", "▁A", "▁b", "▁c",
             "▁Rain", "▁falls", "▁Yes", "!", "?"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Punctuation(behavior="isolated"),
                                                 pre_tokenizers.Metaspace(prepend_scheme="first")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_anchor_id_is_the_sentence_final_period_on_a_metaspace_tokenizer():
    from kvjax.experiments.train_anllm import anchor_ids_of
    from kvjax.anllm_anchors import anchor_flags

    tok = metaspace_tokenizer()
    assert tok.convert_ids_to_tokens(tok(".", add_special_tokens=False)["input_ids"]) == ["▁."]  # the old bug's id
    (anchor,) = anchor_ids_of(tok, ["."])
    assert tok.convert_ids_to_tokens(anchor) == "."
    text = "The sky is blue. Rain falls. It ends here."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    flags = np.asarray(anchor_flags(jnp.asarray([ids]), (anchor,)))[0]
    ends = [i for i, t in enumerate(tok.convert_ids_to_tokens(ids)) if t == "."]
    assert flags.nonzero()[0].tolist() == ends and len(ends) == 3  # every sentence end, nothing else
    assert ends[-1] == len(ids) - 1


def test_by_layer_anchors_in_layer_0_and_streaming_in_layer_1(tiny):
    """Seen before: ByLayer did not forward `prompt_mask`, so AnLLM inside it attended its prompt
    without eq. 4 (and kept what the mask hides) while nothing said so. Now each layer follows its
    own rule: the logits equal the model's layers run with eq. 4 in layer 0 and causally in layer 1,
    layer 0 keeps REDUCTION's tokens and layer 1 StreamingLLM's."""
    from kvjax.policies import StreamingLLM, by_layer

    model, n, p = tiny.model, 50, 24
    ids = _with_anchors(n, seed=8)
    flags = jnp.asarray([[t == ANCHOR for t in ids]])
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    x = model.embed(jnp.asarray([ids]))
    x = model.layers[0](x, pos, None, Forward(anchor_mask(flags)), None, 0)[0]
    x = model.layers[1](x, pos, None, Forward(), None, 1)[0]
    ref = np.asarray(model._logits(x))[0]
    everywhere = np.asarray(drive.logits(model, jnp.asarray([ids]), anchors=anchor_mask(flags)))[0]
    assert np.abs(ref - everywhere)[p:].max() > 1e-3  # the layers' rules really differ

    reduction = AnchorReduction(anchor_ids=(ANCHOR,), anchor_slots=16, sequence=12)
    for budget in (64, 16):  # 64: StreamingLLM never evicts, so the logits are the reference's
        prefill, decode = stepper(model, by_layer(reduction, StreamingLLM(budget=budget, sinks=4), split=1), 64)
        logits, cache = prefill(jnp.asarray([ids[:p]]), pos[:, :p])
        ours = [np.asarray(logits[0])]
        for t in range(p, n):
            logits, cache = decode(jnp.asarray([ids[t]]), jnp.asarray([t]), cache)
            ours.append(np.asarray(logits[0]))
        if budget == 64:
            np.testing.assert_allclose(np.stack(ours), ref[p - 1:], atol=1e-5, rtol=0)
        last = max(i for i in range(n) if ids[i] == ANCHOR)
        held = [sorted(int(q) for q in np.asarray(c.pos[0, 0]) if q >= 0) for c in cache]
        assert held[0] == [i for i in range(n) if ids[i] == ANCHOR or i > last]
        assert held[1] == (list(range(n)) if budget == 64 else [0, 1, 2, 3] + list(range(n - 12, n)))


def test_table_3_placements_every_n_tokens_and_at_random(tiny_dir, tmp_path):
    """AnLLM Table 3: <AC> after every 10 tokens, or after each token with p = 0.1, in training and in
    the evaluation's demonstrations (read back from config.json)."""
    import json

    from kvjax.experiments import eval_anllm, train_anllm
    from kvjax.anllm_anchors import parse_placement, place_anchors
    from kvjax.models import load

    ids = list(range(100, 135))
    every = place_anchors(ids, 7, "every:10")
    assert [i for i, t in enumerate(every) if t == 7] == [10, 21, 32] and [t for t in every if t != 7] == ids
    draws = [place_anchors(list(range(100, 2100)), 7, "random:0.1", seed=s).count(7) for s in range(3)]
    assert all(150 < n < 250 for n in draws) and place_anchors(ids, 7, "random:0.1", 1) == place_anchors(
        ids, 7, "random:0.1", 1)
    for bad in ("every:0", "random:1.5", "often", "sentence:2"):
        with pytest.raises(ValueError, match="placement="):
            parse_placement(bad)

    data = tmp_path / "d.txt"
    data.write_text("The cache holds keys. Anchors compress a sentence! Is it enough? Yes. " * 20)
    out = tmp_path / "out"
    argv = ["--model", str(tiny_dir), "--variant", "ac", "--placement", "every:10", "--out", str(out), "--data",
            str(data), "--steps", "2", "--seq-len", "64", "--batch", "2", "--warmup", "1", "--lr", "1e-3"]
    assert train_anllm.main(argv) == 0
    meta = json.loads((out / "config.json").read_text())["kvjax_anllm"]
    assert meta["placement"] == "every:10"
    ev = tmp_path / "eval"
    assert eval_anllm.main(["--model", str(out), "--out", str(ev), "--items", "4", "--time-items", "0"]) == 0
    res = json.loads((ev / "results.json").read_text())
    tok = load(out).tokenizer
    demos, _ = eval_anllm.fact_task(4, 5, 4, 0)
    plain = []
    for d in demos:
        plain += tok((" " if plain else "") + d, add_special_tokens=False)["input_ids"]
    assert res["placement"] == "every:10" and res["L_d"] == len(plain) + len(plain) // 10
    with pytest.raises(ValueError, match="needs --variant ac"):
        train_anllm.main(argv[:3] + ["ep"] + argv[4:])
    # The paper's Table 3 protocol: one AC model (Table 1's, trained with <AC> after each sentence), its
    # demonstrations' anchors placed every 10 tokens at evaluation only
    sent = tmp_path / "sent"
    assert train_anllm.main([a if a != "every:10" else "sentence" for a in argv[:4]] + ["--out", str(sent)]
                            + argv[8:]) == 0
    ev2 = tmp_path / "eval2"
    assert eval_anllm.main(["--model", str(sent), "--out", str(ev2), "--items", "4", "--time-items", "0",
                            "--placement", "every:10"]) == 0
    res2 = json.loads((ev2 / "results.json").read_text())
    assert res2["placement"] == "every:10" and res2["L_d"] == len(plain) + len(plain) // 10
    assert len(plain) // 10 <= res2["L_kv"] < res2["L_d"]  # the placed anchors (and the tokens after the last)


def test_anchors_in_one_head_group_are_refused_with_the_reason(tiny):
    """Per head, AnLLM cannot work (its eq. 4 mask shapes every head's prompt attention): the plan refuses it
    by name instead of running it wrong."""
    from kvjax.policies import FullCache, by_head

    policy = by_head([[True, False], [True, False]], AnchorReduction(anchor_ids=(ANCHOR,)), FullCache())
    with pytest.raises(ValueError, match="cannot cache a head group of layer 0.*by_layer"):
        drive.empty_cache(tiny.model, drive.plan(tiny.model, policy, 64, 32), 1)


def test_identity_train_anllm_never_reads_the_held_out_topics(tiny_dir, tmp_path, monkeypatch):
    """The default text's held-out topics (`kvjax.experiments.corpus`) are what the zero-shot and LongBench passages
    and perplexity's default text are made of: `train_anllm` must not train on them, or an evaluation of the
    trained model on them scores text it learned. No 128-token stretch of a held-out topic (bytes: 128
    characters) is in a training window. Before 2026-11-27 it trained on every topic."""
    from kvjax.experiments import corpus, train_anllm
    from kvjax.models import load

    class Stop(Exception):
        pass

    seen = {}

    def fake_train(model, batch, loss, cfg, out, **kw):
        seen["rows"] = np.concatenate([np.asarray(batch(i)["tokens"]) for i in range(2000)])
        raise Stop

    monkeypatch.setattr(train_anllm, "train", fake_train)
    with pytest.raises(Stop):
        train_anllm.main(["--model", str(tiny_dir), "--variant", "ep", "--out", str(tmp_path / "m")])
    tok = load(tiny_dir).tokenizer
    rows = seen["rows"]
    assert len(np.unique(rows, axis=0)) > 1000  # every window of the text, read in batches of 4
    trained = {r[i : i + 128].tobytes() for r in rows for i in range(rows.shape[1] - 128 + 1)}
    for name, text in corpus.doc_documents("heldout"):
        ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"], np.int32)
        assert not any(ids[i : i + 128].tobytes() in trained for i in range(len(ids) - 128 + 1)), name
