"""Training the default model: corpus split, tokenizer, task rows, and the command end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax.experiments import corpus
from kvjax.experiments import train_tiny as tt
from kvjax.experiments.records import ResultLog
from kvjax.experiments.tasks import PASSKEY_QUESTION, Curriculum, RowSampler
from kvjax import drive


@pytest.fixture(scope="module")
def bpe():
    texts = [t for _, t in corpus.code_documents("train")[:40]] + [t for _, t in corpus.doc_documents("train")[:10]]
    return tt.train_bpe(texts, 400)


def test_corpus_split_is_disjoint_and_stable():
    train = {n for n, _ in corpus.code_documents("train")}
    held = {n for n, _ in corpus.code_documents("heldout")}
    assert train and held and not train & held
    assert {n for n, _ in corpus.code_documents("heldout")} == held  # a pure function of the names
    assert not any(n.startswith(("test/", "encodings/", "idlelib/")) for n in train | held)
    docs = {n for n, _ in corpus.doc_documents("train")} | {n for n, _ in corpus.doc_documents("heldout")}
    from pydoc_data.topics import topics

    assert docs == set(topics)
    with pytest.raises(ValueError, match="split='dev'"):
        corpus.code_documents("dev")


def test_bpe_splits_digits_round_trips_and_prepends_bos(bpe):
    text = "def f(x):\n    return x + 12345  # é ✓"
    ids = bpe(text)["input_ids"]
    assert ids[0] == bpe.bos_token_id == 1 and bpe.pad_token_id == 3 and bpe.eos_token_id == 2
    assert bpe.decode(ids, skip_special_tokens=True) == text
    toks = bpe.convert_ids_to_tokens(bpe(" 12345", add_special_tokens=False)["input_ids"])
    assert toks[-5:] == ["1", "2", "3", "4", "5"]  # one token per digit: keys are copied digit by digit
    with pytest.raises(ValueError, match="vocab_size=100 must be >= 260"):
        tt.train_bpe(["x"], 100)


def test_rows_have_exact_length_weighted_answers_and_are_deterministic(bpe):
    stream = np.asarray(bpe(" ".join(t for _, t in corpus.doc_documents("train")[:5]),
                            add_special_tokens=False)["input_ids"], np.int32)
    sampler = RowSampler(bpe, stream, stream, 256, answer_weight=4.0)
    rows = [sampler.row(np.random.default_rng([0, i]), 200) for i in range(40)]
    again = [sampler.row(np.random.default_rng([0, i]), 200) for i in range(40)]
    for (ids, w), (ids2, w2) in zip(rows, again):
        assert ids.shape == w.shape == (256,) and ids.dtype == np.int32
        assert ids[0] == bpe.bos_token_id
        np.testing.assert_array_equal(ids, ids2)
        np.testing.assert_array_equal(w, w2)
    question = bpe(PASSKEY_QUESTION, add_special_tokens=False)["input_ids"]
    passkeys = 0
    for ids, w in rows:
        text = bpe.decode(ids)
        if PASSKEY_QUESTION in text:  # a passkey row: the weighted tail is the key of the needle
            passkeys += 1
            assert set(np.unique(w)) == {1.0, 4.0}
            answer = bpe.decode(ids[w == 4.0])
            key = answer.strip().removesuffix(".")
            assert answer == f" {key}." and f"The pass key is {key}. Remember it. {key} is the pass key." in text
            n = int((w == 4.0).sum())  # " ", five digits and ".", at the very end, right after the question
            assert n == 7 and list(ids[-len(question) - n : -n]) == question
    assert passkeys >= 3


def test_train_tiny_writes_a_model_that_both_frameworks_load_and_resumes(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import LlamaForCausalLM

    from kvjax.models import load

    out = tmp_path / "m"
    argv = ["--out", str(out), "--seq-len", "256", "--batch", "2", "--vocab", "300", "--hidden", "32", "--ffn",
            "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--warmup", "1", "--save-every", "2",
            "--warm-steps", "1", "--warm-len", "64", "--warm-batch", "3", "--no-eval"]
    assert tt.main(argv + ["--steps", "2"]) == 0
    assert json.loads((out / "training" / "run.json").read_text())["resumed_from"] == 0
    assert tt.main(argv + ["--steps", "2"]) == 0  # resumes at step 2: the tokenizer and data are reused
    run = json.loads((out / "training" / "run.json").read_text())
    assert run["resumed_from"] == 2 and run["args"]["steps"] == 2
    # a cosine schedule spans its steps: a longer run is another run, refused rather than resumed
    with pytest.raises(ValueError, match="TrainConfig.steps: 1 -> 2"):
        tt.main(argv + ["--steps", "3"])
    lm = load(out)
    assert lm.config.max_position_embeddings == 256 and lm.config.num_kv_heads == 1
    ids = lm.tokenizer("import os\nprint(1)")["input_ids"]
    ours = np.asarray(drive.logits(lm.model, np.asarray([ids])))
    hf = LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_train_tiny_rejects_bad_shapes(capsys):
    with pytest.raises(SystemExit):
        tt.main(["--hidden", "30", "--heads", "4"])
    assert "--hidden 30 must divide by --heads 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tt.main(["--steps", "100", "--warm-steps", "100"])
    assert "--warm-steps 100 must be in [0, --steps 100)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tt.main(["--warm-len", "16"])
    assert "--warm-len 16 must hold two periods" in capsys.readouterr().err


def test_warm_stage_is_short_wide_rows_of_pure_repeats_then_the_main_rows(bpe):
    stream = np.asarray(bpe(" ".join(t for _, t in corpus.doc_documents("train")[:5]),
                            add_special_tokens=False)["input_ids"], np.int32)
    data = {"code_train": stream, "docs_train": stream}
    args = tt.parse(["--seq-len", "320", "--batch", "3", "--steps", "20", "--warm-steps", "5", "--warm-len", "64",
                     "--warm-batch", "6"])
    batch = tt.batches(args, bpe, data)
    for i in range(5):
        b = batch(i)
        ids, w = np.asarray(b["tokens"]), np.asarray(b["weights"])
        assert ids.shape == w.shape == (6, 64) and (ids[:, 0] == bpe.bos_token_id).all()
        for row, wt in zip(ids, w):  # BOS, then one period of ids < 4 + 64 repeated to the end
            k = next(k for k in range(4, 17) if (row[1 + k :] == row[1 : -k]).all())
            assert 4 <= row[1:].min() and row[1:].max() < 4 + 64
            assert (wt[1 : 1 + k] == 0).all() and (wt[1 + k :] == 1).all()
    np.testing.assert_array_equal(batch(3)["tokens"], batch(3)["tokens"])  # a pure function of the step
    assert batch(5)["tokens"].shape == batch(19)["tokens"].shape == (3, 320)
    with pytest.raises(ValueError, match="--seq-len 256 is too short for the tasks with this tokenizer"):
        tt.batches(tt.parse(["--seq-len", "256"]), tt.train_bpe(["a b"], 260), data)


def test_result_log_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"id": 1, "x": 1}\n{"id": 2, "x": 2}\n{"id": 3, "x"')
    log = ResultLog(path)
    assert len(log) == 2 and 3 not in log and 2 in log
    log.add({"id": 3, "x": 3})
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == [1, 2, 3]
    path.write_text('{"id": 1}\nnot json\n{"id": 2}\n')
    with pytest.raises(ValueError, match="log.jsonl:2 is not valid JSON"):
        ResultLog(path)


def test_induction_rows_repeat_random_tokens_and_do_not_score_the_first_copy(bpe):
    stream = np.arange(4, 300, dtype=np.int32).repeat(4)
    sampler = RowSampler(bpe, stream, stream, 256)
    segments = sampler._induction(np.random.default_rng(3), 200)
    (first, w0), *rest = segments
    assert w0 == 0.0 and all(w == 1.0 for _, w in rest)
    assert sum(len(s) for s, _ in segments) == 200 and min(first) >= 4 and max(first) < len(bpe)
    joined = [t for s, _ in segments for t in s]
    k = len(first)
    assert joined[k:] == (first * 10)[: 200 - k]  # every later token is the one k positions back


def test_curriculum_opens_on_short_small_alphabet_induction_and_reaches_the_main_regime(bpe):
    c = Curriculum()
    assert c.at(0.0, 2048) == (c.warm, 64, (4, 16)) == c.at(c.hold, 2048)
    assert c.at(1.0, 2048) == (c.main, 2048, (16, 64)) == c.at(3.0, 2048)
    mid = c.at((c.hold + 1) / 2, 2048)
    assert 64 < mid[1] < 2048 and mid[0].induction == pytest.approx((c.warm.induction + c.main.induction) / 2)

    stream = np.arange(4, 300, dtype=np.int32).repeat(4)
    sampler = RowSampler(bpe, stream, stream, 256)
    for seed in range(20):
        segments = sampler._induction(np.random.default_rng(seed), 200, alphabet=64, period=(4, 16))
        first = segments[0][0]
        assert 4 <= len(first) <= 16 and 4 <= min(first) and max(first) < 4 + 64
    # the warm regime's rows are mostly induction: a row scores tokens that repeat one period back
    with pytest.raises(ValueError, match="span=20 is too short"):
        sampler._passkey(np.random.default_rng(0), 20)
    rows = [sampler.row(np.random.default_rng([1, i]), 200, c.at(0.0, len(bpe))) for i in range(50)]
    periodic = sum(any((ids[-64:] == np.roll(ids, k)[-64:]).all() for k in range(4, 17)) for ids, _ in rows)
    assert 33 <= periodic <= 49  # 85 % expected


def test_sink_shares_are_the_mean_and_strongest_head_share_of_the_first_token():
    import jax.numpy as jnp
    from flax import nnx

    from kvjax.experiments import model_card
    from kvjax.heads import attention_maps
    from kvjax.models.llama import Llama
    from kvjax.models.tiny import tiny_config

    model = Llama(tiny_config(), rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(4, 200, (2, 40)).astype(np.int32)
    sink = model_card.sink_shares(model, tokens)
    maps = [np.asarray(p) for p in attention_maps(model, jnp.asarray(tokens))]
    skip = model_card.SINK_SKIP
    for p, mean, strongest in zip(maps, sink["first_token_share"], sink["strongest_head_share"]):
        per_head = [p[:, h, skip:, 0].mean() for h in range(p.shape[1])]
        assert mean == pytest.approx(np.mean(per_head), rel=1e-5)
        assert strongest == pytest.approx(max(per_head), rel=1e-5)
    assert sink["uniform_share"][0] == pytest.approx(np.mean([1 / (q + 1) for q in range(skip, 40)]))
