"""Needle in a haystack: insertion at the requested depth on a sentence boundary, exact prompt length, scoring."""

from __future__ import annotations

import json

import pytest

from kvjax.experiments import needle


@pytest.fixture(scope="module")
def hay(tiny):
    text = " ".join(f"Sentence number {i} is here." for i in range(200))
    return tiny.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("length", [200, 333, 600])
@pytest.mark.parametrize("depth", [0, 10, 50, 90, 100])
def test_needle_lands_at_depth_on_a_sentence_boundary_and_prompt_fits(tiny, hay, length, depth):
    tok = tiny.tokenizer  # byte level: one token per character
    ids, at = needle.needle_prompt(tok, hay, length, depth, needle.NEEDLE, needle.QUESTION)
    assert len(ids) == length
    text = tok.decode(ids[1:])
    assert text.endswith(needle.QUESTION) and text.count(needle.NEEDLE) == 1
    assert tok.decode(ids[at : at + len(needle.NEEDLE)]) == needle.NEEDLE
    before = tok.decode(ids[1:at])
    assert before == "" or before.endswith(".")
    room = length - 1 - len(needle.NEEDLE) - len(needle.QUESTION)
    want = int(room * depth / 100)
    sentence = len(" Sentence number 123 is here.")
    assert want - sentence <= at - 1 <= want  # moved back, never forward, by less than a sentence


def test_needle_errors(tiny, hay):
    with pytest.raises(ValueError, match="depth=120"):
        needle.needle_prompt(tiny.tokenizer, hay, 300, 120, needle.NEEDLE, needle.QUESTION)
    with pytest.raises(ValueError, match="length=50 leaves no room"):
        needle.needle_prompt(tiny.tokenizer, hay, 50, 50, needle.NEEDLE, needle.QUESTION)
    with pytest.raises(ValueError, match="the haystack has 10 tokens"):
        needle.needle_prompt(tiny.tokenizer, hay[:10], 300, 50, needle.NEEDLE, needle.QUESTION)


@pytest.mark.parametrize("answer, rouge, exact", [
    ("Ravendor", 1 / 6, True),                                    # the needle has 6 words
    ("The founder of Kalomiven is Ravendor.", 1.0, True),
    ("the founder is unknown", 3 / 6, False),                     # "the", "founder", "is"
    ("", 0.0, False),
    ("ravendor ravendor", 1 / 6, True),                           # repeats count once per reference word
])
def test_scoring_hand_cases(answer, rouge, exact):
    assert needle.rouge1_recall(answer, needle.NEEDLE) == pytest.approx(rouge)
    assert needle.exact_match(answer, needle.ANSWER) is exact


def test_cli_grid_heatmap_and_resume(tmp_path, tiny_dir):
    hay = tmp_path / "hay"
    hay.mkdir()
    (hay / "a.txt").write_text(" ".join(f"Line {i} of the haystack." for i in range(300)))
    out = tmp_path / "out"
    argv = ["--model", str(tiny_dir), "--haystack", str(hay), "--lengths", "200,300", "--depths", "0,50,100",
            "--compare", "full,streaming", "--budget", "64", "--out", str(out)]
    assert needle.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res) == {"full", "streaming"} and res["full"]["lengths"] == [200, 300]
    assert len(res["full"]["exact_grid"]) == 3 and (out / "heatmap_streaming.png").is_file()
    assert (out / "cells.jsonl").read_text().count("\n") == 12
    assert needle.main(argv) == 0  # everything is reused
    assert (out / "cells.jsonl").read_text().count("\n") == 12
    with pytest.raises(FileNotFoundError, match="has no .txt files"):
        needle.main(["--model", str(tiny_dir), "--haystack", str(tmp_path / "out"), "--out", str(out)])


def test_records_hold_kv_held_and_a_record_without_it_shows_blank(tmp_path, tiny_dir):
    """Each record's `kv_held` is the share of the full cache's KV bytes its prompt held (the full cache all of it,
    StreamingLLM at budget 64 its 64 slots of the 200-token prompt); each policy's table has a "KV held" row, the
    length's mean, and its summary a "kv_held" entry. A record from before the field is not recomputed: its
    length's cell is blank (None in the summary), never 0."""
    from kvjax.experiments import driver

    hay = tmp_path / "hay"
    hay.mkdir()
    (hay / "a.txt").write_text(" ".join(f"Line {i} of the haystack." for i in range(300)))
    lm = driver.load_model(tiny_dir)
    pols = driver.resolve_policies("full,streaming", budget=64)
    out = tmp_path / "out"
    kw = {"lengths": [200], "depths": [0.0, 100.0], "haystack": str(hay), "progress": False}
    res = needle.suite(lm, pols, out, **kw)
    path = out / "cells.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(recs) == 4 and all(0 < r["kv_held"] <= 1 for r in recs)
    assert [r["kv_held"] for r in recs if r["label"] == "full"] == [1.0, 1.0]
    assert [r["kv_held"] for r in recs if r["label"] == "streaming"] == [round(64 / 200, 6)] * 2
    assert res.summary["full"]["kv_held"] == {"200": 1.0} and res.summary["streaming"]["kv_held"] == {"200": 0.32}

    def held_row(table, label):
        section = table.split(f"### {label}:", 1)[1].split("\n\n###", 1)[0]
        return next(line for line in section.splitlines() if line.startswith("| KV held |"))

    assert held_row(res.table, "full") == "| KV held | 1.0000 |"
    assert held_row(res.table, "streaming") == "| KV held | 0.3200 |"
    # a record written before the field: kept as it is, its length's cell blank
    old = [r if r["label"] != "streaming" or r["depth"] != 100.0 else {k: v for k, v in r.items() if k != "kv_held"}
           for r in recs]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    again = needle.suite(lm, pols, out, **kw)
    assert [json.loads(line) for line in path.read_text().splitlines()] == old  # nothing recomputed
    assert held_row(again.table, "streaming") == "| KV held |  |"
    assert held_row(again.table, "full") == "| KV held | 1.0000 |"
    assert again.summary["streaming"]["kv_held"] == {"200": None}
    assert again.summary["streaming"]["exact_grid"] == res.summary["streaming"]["exact_grid"]
