"""Zero-shot multiple choice: scores equal a hand computation with a full forward."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax.experiments import zeroshot
from kvjax.policies import FullCache, StreamingLLM
from kvjax import drive

ITEMS = [
    {"context": "The sky is blue. Grass is green.", "query": " The sky is", "choices": [" blue", " green", " red"],
     "gold": 0},
    {"context": "", "query": "Two plus two is", "choices": [" four", " five hundred"], "gold": 0},
    {"context": "Cats purr.", "query": " Dogs", "choices": [" bark", " meow", " purr loudly"], "gold": 2},
]


def _by_hand(model, tok, row):
    """log p(choice | BOS + context + query) from one causal forward per choice, in float64."""
    out = []
    for c in row["choices"]:
        ctx = [tok.bos_token_id] + tok(row["context"] + row["query"], add_special_tokens=False)["input_ids"]
        ch = tok(c, add_special_tokens=False)["input_ids"]
        logits = np.asarray(drive.logits(model, np.asarray([ctx + ch])), np.float64)[0]
        m = logits.max(-1, keepdims=True)
        lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
        out.append(sum(lp[len(ctx) - 1 + i, t] for i, t in enumerate(ch)))
    return np.asarray(out)


def test_scores_equal_a_hand_computation(sharp_dir):
    from kvjax.models import load

    lm = load(sharp_dir)
    tok = lm.tokenizer
    for row in ITEMS:
        got = zeroshot.score_item(lm.model, tok, row, FullCache())
        want = _by_hand(lm.model, tok, row)
        np.testing.assert_allclose(got["logprobs"], want, rtol=1e-5, atol=1e-5)
        assert got["acc"] == (int(np.argmax(want)) == row["gold"])
        norm = want / np.asarray([len(c) for c in row["choices"]])
        assert got["acc_norm"] == (int(np.argmax(norm)) == row["gold"])


def test_policy_is_applied_to_the_context(sharp_dir):
    from kvjax.models import load

    lm = load(sharp_dir)
    row = {"context": "x" * 200 + " The key is 42.", "query": " The key is", "choices": [" 42", " 17"], "gold": 0}
    full = zeroshot.score_item(lm.model, lm.tokenizer, row, FullCache())["logprobs"]
    small = zeroshot.score_item(lm.model, lm.tokenizer, row, StreamingLLM(budget=32, sinks=4))["logprobs"]
    assert np.abs(np.asarray(full) - np.asarray(small)).max() > 1e-3


def test_cli_on_a_jsonl_task_and_errors(tmp_path, tiny_dir, capsys):
    data = tmp_path / "task.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ITEMS))
    out = tmp_path / "out"
    assert zeroshot.main(["--model", str(tiny_dir), "--data", str(data), "--compare", "full,streaming",
                          "--budget", "32", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())["results"]
    from kvjax.models import load

    lm = load(tiny_dir)
    hand = [_by_hand(lm.model, lm.tokenizer, row) for row in ITEMS]
    acc = np.mean([int(np.argmax(h)) == row["gold"] for h, row in zip(hand, ITEMS)])
    norm = np.mean([int(np.argmax(h / np.asarray([len(c) for c in row["choices"]]))) == row["gold"]
                    for h, row in zip(hand, ITEMS)])
    assert res["full"]["items"] == 3
    assert res["full"]["acc"] == pytest.approx(acc) and res["full"]["acc_norm"] == pytest.approx(norm)
    # every item is shorter than the 32-slot window, so StreamingLLM evicts nothing: the full cache's scores
    assert res["streaming"]["acc"] == pytest.approx(acc) and res["streaming"]["acc_norm"] == pytest.approx(norm)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"context": "", "query": "q", "choices": ["a", "b"]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: item is missing field 'gold'"):
        zeroshot.read_items(str(bad))
    bad.write_text(json.dumps({"context": "", "query": "q", "choices": ["a", "b"], "gold": 2}) + "\n")
    with pytest.raises(ValueError, match="gold=2 is not an index into 2 choices"):
        zeroshot.read_items(str(bad))
    with pytest.raises(SystemExit):  # --facts shapes the built-in task only: refused with --data
        zeroshot.main(["--model", str(tiny_dir), "--data", str(data), "--facts", "1", "--out", str(tmp_path / "o2")])
    assert "--facts 1 shapes the built-in task" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # so do --items and --seed, which the items of --data would silently ignore
        zeroshot.main(["--model", str(tiny_dir), "--data", str(data), "--items", "5", "--seed", "3",
                       "--out", str(tmp_path / "o3")])
    assert f"--items 5 --seed 3 shape the built-in task; --data {data} brings its own items" in capsys.readouterr().err


def test_builtin_task_is_deterministic():
    a, b = zeroshot.builtin_task(5, seed=1), zeroshot.builtin_task(5, seed=1)
    assert a == b and all(len(r["choices"]) == 4 and r["query"].startswith("\nQuestion:") for r in a)
    for r in a:
        assert r["choices"][r["gold"]].strip() in r["context"]


def test_builtin_task_with_one_fact_holds_only_the_gold_value():
    """`facts=1` (the task a model too small for associative recall can do): the passage holds the gold
    value and none of the three others, the question names the hidden subject, and the gold's place
    varies; the default 4-fact items are unchanged by the option (the same seed, the same items)."""
    rows = zeroshot.builtin_task(40, seed=0, facts=1)
    for r in rows:
        held = [c.strip() in r["context"] for c in r["choices"]]
        assert held == [i == r["gold"] for i in range(4)], held
        subject = r["query"].split("capital of ")[1].split("?")[0]
        assert f"The capital of {subject} is {r['choices'][r['gold']].strip()}." in r["context"]
    assert len({r["gold"] for r in rows}) == 4
    assert zeroshot.builtin_task(3, seed=0, facts=4) == zeroshot.builtin_task(3, seed=0)
    with pytest.raises(ValueError, match="facts=5"):
        zeroshot.builtin_task(3, facts=5)


def test_stream_scoring_reads_every_token_under_the_policy(sharp_dir):
    """`--scoring stream` (MAT's protocol): with a full cache it is the hand computation; under a ratio
    budget the choices of an item (sequences of different lengths, one batch) each keep their own
    share, i.e. each equals its sequence scored alone under a token budget of floor(n (1 - r))."""
    from kvjax import scoring
    from kvjax.models import load

    lm = load(sharp_dir)
    tok = lm.tokenizer
    for row in ITEMS:
        got = zeroshot.score_item(lm.model, tok, row, FullCache(), "stream")
        np.testing.assert_allclose(got["logprobs"], _by_hand(lm.model, tok, row), rtol=1e-5, atol=1e-5)
    row = {"context": "The quick brown fox jumps over the lazy dog. " * 3, "query": " The fox is",
           "choices": [" quick", " brown and very quick indeed", " lazy"], "gold": 0}
    ratio = 0.5
    got = zeroshot.score_item(lm.model, tok, row, StreamingLLM(budget=None, ratio=ratio, sinks=4), "stream")
    ctx = [tok.bos_token_id] + tok(row["context"] + row["query"], add_special_tokens=False)["input_ids"]
    want = []
    for c in row["choices"]:
        ch = tok(c, add_special_tokens=False)["input_ids"]
        budget = int(np.floor(len(ctx + ch) * (1 - ratio)))
        lp = scoring.stream_logprobs(lm.model, ctx + ch, StreamingLLM(budget=budget, sinks=4))
        want.append(lp[len(lp) - len(ch):].sum())
    assert len({len(tok(c, add_special_tokens=False)["input_ids"]) for c in row["choices"]}) > 1
    np.testing.assert_allclose(got["logprobs"], want, rtol=1e-5, atol=1e-5)
    full = zeroshot.score_item(lm.model, tok, row, FullCache(), "stream")["logprobs"]
    assert np.abs(np.asarray(full) - np.asarray(got["logprobs"])).max() > 1e-3  # the budget bites


def test_cli_table_2_protocol_sweeps_kv_ratios_resumes_and_keeps_its_identity(tmp_path, tiny_dir):
    """MAT Table 2 / Fig. 4 end to end: --scoring stream --ratios over full, StreamingLLM and MAT; a rerun
    with one more ratio computes only the new records; another --scoring is refused for that OUT."""
    data = tmp_path / "task.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ITEMS))
    out = tmp_path / "out"
    argv = ["--model", str(tiny_dir), "--data", str(data), "--compare", "full,streaming,mat", "--anchor-slots", "2",
            "--sinks", "2", "--scoring", "stream", "--out", str(out)]
    assert zeroshot.main(argv + ["--ratios", "0.5"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["results"]) == {"full", "streaming@0.5", "mat@0.5"} and res["scoring"] == "stream"
    assert "ratio=0.5" in res["results"]["mat@0.5"]["policy"] and (out / "accuracy_vs_kv.png").is_file()
    assert "| mat@0.5 | 50 |" in (out / "results.md").read_text()
    first = (out / "items.jsonl").read_text()
    assert zeroshot.main(argv + ["--ratios", "0.5,0.25"]) == 0
    grown = (out / "items.jsonl").read_text()
    assert grown.startswith(first) and len(grown.splitlines()) == len(first.splitlines()) + 2 * len(ITEMS)
    with pytest.raises(ValueError, match="--scoring"):
        zeroshot.main([a if a != "stream" else "prefix" for a in argv] + ["--ratios", "0.5"])
    with pytest.raises(ValueError, match="--ratio 0.5 sizes each row's c as a share of its prompt, but --anchor-slots None"):
        zeroshot.main(["--model", str(tiny_dir), "--data", str(data), "--compare", "mat", "--ratios", "0.5",
                       "--out", str(tmp_path / "o2")])


def test_held_share_counts_what_each_head_keeps(tiny):
    """The KV share the Table 2 sweep plots is measured: a 40-token context under FullCache holds all of it,
    StreamingLLM(16) 16 / 40, and a head split keeping everything in one KV head of two and 8 tokens in the
    other (RazorAttention's shape) (40 + 8) / 80, not the local heads' share."""
    from kvjax.fewshot import prefix_cache
    from kvjax.policies import FullCache, LocalWindow, StreamingLLM, by_head

    ids = list(range(5, 45))
    share = lambda policy: zeroshot.held_share(prefix_cache(tiny.model, ids, policy, 4), len(ids))  # noqa: E731
    assert share(FullCache()) == 1.0
    assert share(StreamingLLM(budget=16, sinks=4)) == 16 / 40
    assert share(by_head([[True, False]] * 2, FullCache(), LocalWindow(size=8))) == (40 + 8) / 80
