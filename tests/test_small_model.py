"""kvjax-small (kvjax/models/small, made by kvjax.experiments.train_small): it loads in both frameworks, uses its
2048-token context, has attention sinks and a minority of retrieval heads (the model card's targets)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax.experiments import passkey
from kvjax.experiments.records import ResultLog
from kvjax.policies import FullCache, StreamingLLM
from kvjax.models import SMALL_DIR
from kvjax import drive

pytestmark = pytest.mark.skipif(not (SMALL_DIR / "model.safetensors").is_file(),
                                reason="kvjax-small is not in this checkout")


@pytest.fixture(scope="module")
def small():
    from kvjax.models import load

    return load(SMALL_DIR)


def test_config_is_deeper_and_longer_than_the_default(small):
    c = small.config
    assert c.num_layers >= 4 and c.max_position_embeddings >= 2048 and c.num_kv_heads < c.num_heads
    assert sum(p.stat().st_size for p in SMALL_DIR.iterdir() if p.is_file()) < 45e6


def test_logits_match_transformers_pytorch(small):
    torch = pytest.importorskip("torch")
    from transformers import LlamaForCausalLM

    text = "The value of key 4821 is 59302.\nWhat is the pass key? The pass key is"
    ids = small.tokenizer(text)["input_ids"]
    ours = np.asarray(drive.logits(small.model, np.asarray([ids])))
    hf = LlamaForCausalLM.from_pretrained(SMALL_DIR).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.slow  # 70 s on 2 cores; the default suite's passkey checks run on the embedded default model
def test_passkey_at_the_full_context_and_not_outside_a_streaming_window(small, tmp_path):
    """The model reads its whole context: at half of it and at the full 2048 tokens the full cache retrieves
    the key almost always (the card's target is 95 % at 2K; 10 of 10 here, one miss allowed for another
    CPU's rounding), and a StreamingLLM window that excludes the key never does."""
    n = small.config.max_position_embeddings
    length = n - passkey.MAX_NEW_TOKENS
    log = ResultLog(tmp_path / "p.jsonl")
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    half = passkey.run(small.model, small.tokenizer, FullCache(), [n // 2], depths, 2, log, seed=321, label="full",
                       progress=False)
    full = passkey.run(small.model, small.tokenizer, FullCache(), [length], depths, 2, log, seed=321, label="full",
                       progress=False)
    window = StreamingLLM(budget=256, sinks=4)
    stream = passkey.run(small.model, small.tokenizer, window, [length], [0.0, 0.25, 0.5], 2, log, seed=321,
                         label="streaming", progress=False)
    assert all(r["needle_at"] + 20 < length - (256 - 4) for r in stream)  # the key is outside the window
    assert np.mean([r["correct"] for r in half]) >= 0.9, [r["output"] for r in half if not r["correct"]]
    assert np.mean([r["correct"] for r in full]) >= 0.9, [r["output"] for r in full if not r["correct"]]
    assert np.mean([r["correct"] for r in stream]) <= 0.1


def test_retrieval_heads_are_a_minority_and_the_shipped_table_is_the_probes(small, tmp_path):
    from kvjax.experiments import find_heads

    shipped = json.loads((SMALL_DIR / "heads.json").read_text())["retrieval_kv_heads"]
    n = small.config.max_position_embeddings
    assert find_heads.main(["--model", str(SMALL_DIR), "--out", str(tmp_path / "h.json"), "--k", str(n // 8),
                            "--repeats", "4"]) == 0
    assert json.loads((tmp_path / "h.json").read_text())["retrieval_kv_heads"] == shipped
    count, total = sum(map(sum, shipped)), len(shipped) * len(shipped[0])
    assert 0 < count < total / 2, shipped


@pytest.mark.slow  # every dataset of the suite on the committed model: 100 s on 2 cores
def test_every_suite_dataset_scores_and_the_lookups_use_the_far_context(tmp_path):
    """The card's suite row and the README's main-job table, full cache against a StreamingLLM window of 256
    slots, 20 samples each (the card's). Every dataset scores well above 0 with the full cache, and the window
    scores less wherever the answer sits outside it: passkey 100 against 20; kv_retrieval (tables of 32-128
    lines) 80 against 25; paragraph_kv (11 key-value lines, one opening each paragraph of 1400-1800 tokens of
    prose) 95 against 20, the window holding the last paragraph or two; marker_count (a sound line 1-5 times
    in 1800 tokens, chance 20) 40 against 20; QA 16.7 (qa_f1) against 3.3. lcc (code_sim, 36.9) needs little
    far context (the window scores 35.2) and is left to the card."""
    from kvjax.experiments.longbench.__main__ import main

    datasets = ("passkey", "kv_retrieval", "paragraph_kv", "marker_count", "qa")
    assert main(["--model", str(SMALL_DIR), "--datasets", ",".join(f"stdlib_{d}" for d in datasets),
                 "--compare", "full,streaming", "--budget", "256", "--samples", "20", "--out", str(tmp_path)]) == 0
    table = json.loads((tmp_path / "results.json").read_text())["table"]
    passkey, kv, para, count, qa = (table[f"stdlib_{d}"] for d in datasets)
    assert passkey["full"] >= 90 and passkey["streaming"] <= 40, passkey
    assert kv["full"] >= 60 and kv["streaming"] < kv["full"], kv
    assert para["full"] >= 80 and para["streaming"] <= 40, para
    assert count["full"] >= 30 and count["streaming"] < count["full"], count
    assert qa["full"] >= 10 and qa["streaming"] < qa["full"], qa


def test_sinks_are_per_layer_and_strongest_where_the_retrieval_heads_are(small):
    """The card's sink line: the first token draws > 5x uniform attention from the mean head of some layer
    (layer 3, 6.6x on the card, the layer of both retrieval heads) and not from every layer (layers 1-2
    attend to it about uniformly), so sinks differ per layer, as the card's table says."""
    from kvjax.experiments import model_card
    from kvjax.experiments.corpus import doc_documents

    tok, n = small.tokenizer, small.config.max_position_embeddings
    text = " ".join(t for _, t in doc_documents("heldout"))
    rows = np.asarray([tok(text[i * 9000 :])["input_ids"][:n] for i in range(2)], np.int32)
    sink = model_card.sink_shares(small.model, rows)
    ratio = np.asarray(sink["first_token_share"]) / sink["uniform_share"][0]
    shipped = json.loads((SMALL_DIR / "heads.json").read_text())["retrieval_kv_heads"]
    assert ratio.max() > 5 and ratio.min() < 2, ratio
    assert any(shipped[int(ratio.argmax())]), (ratio, shipped)


@pytest.mark.slow  # over 20 s on 2 cores (issue 88: the default suite within 15 minutes)
def test_niah_single_1_at_the_full_context(tmp_path):
    """The card's RULER line (90 % on 20 samples at 2048 tokens, target 80 %): RULER's niah_single_1 with the
    full cache on 10 samples of the card's seed finds the needle at least 8 times (10 measured)."""
    from kvjax.experiments.ruler.__main__ import main

    assert main(["--model", str(SMALL_DIR), "--tasks", "niah_single_1", "--lengths", "2048", "--samples", "10",
                 "--policy", "full", "--out", str(tmp_path)]) == 0
    score = json.loads((tmp_path / "results.json").read_text())["scores"]["full"]["niah_single_1"]["2048"]
    assert score >= 80, score
