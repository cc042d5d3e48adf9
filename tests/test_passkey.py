"""The passkey suite: prompts of an exact length with the needle at a sentence boundary; scoring; resume."""

from __future__ import annotations

import json

import pytest

from kvjax.experiments import passkey
from kvjax.experiments.records import ResultLog
from kvjax.experiments.tasks import PASSKEY_INTRO, PASSKEY_QUESTION, passkey_needle
from kvjax.policies import FullCache


@pytest.mark.parametrize("length", [300, 457, 600])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_prompt_has_exact_length_and_needle_at_a_sentence_boundary(tiny, length, depth):
    tok = tiny.tokenizer  # byte level: a token per character
    ids, at = passkey.passkey_prompt(tok, length, depth, 12345)
    assert len(ids) == length
    text = tok.decode(ids)
    needle = passkey_needle(12345)
    assert text.endswith(PASSKEY_QUESTION) and text.count(needle) == 1
    assert tok.decode(ids[at : at + len(needle)]) == needle
    before = tok.decode(ids[:at])
    assert before.endswith((".", "them. I will quiz you about the important information there."))
    # the boundary chosen is the one nearest the requested depth of the garbage
    head = 1 + len(PASSKEY_INTRO)  # BOS + the task description, a token per character
    room = length - head - len(needle) - len(PASSKEY_QUESTION)
    assert abs((at - head) - depth * room) <= len(" There and back again.") / 2 + 1


def test_prompt_too_short_and_bad_depth(tiny):
    with pytest.raises(ValueError, match="length=50 is shorter than the passkey prompt"):
        passkey.passkey_prompt(tiny.tokenizer, 50, 0.5, 1)
    with pytest.raises(ValueError, match="depth=1.5"):
        passkey.passkey_prompt(tiny.tokenizer, 300, 1.5, 1)


def test_first_int():
    assert passkey.first_int(" 68079. Remember") == 68079
    assert passkey.first_int("no digits") is None


def test_run_scores_and_resumes(tiny, tmp_path):
    log = ResultLog(tmp_path / "s.jsonl")
    recs = passkey.run(tiny.model, tiny.tokenizer, FullCache(), [300], [0.0, 1.0], 2, log, progress=False, label="f")
    assert len(recs) == 4 and all(isinstance(r["correct"], bool) for r in recs)
    for r in recs:  # a random model: correct exactly when its output starts with the key
        assert r["correct"] == (passkey.first_int(r["output"]) == r["key"])
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    (tmp_path / "s.jsonl").write_text("\n".join(lines[:2]) + "\n")
    again = passkey.run(tiny.model, tiny.tokenizer, FullCache(), [300], [0.0, 1.0], 2, ResultLog(tmp_path / "s.jsonl"),
                        progress=False, label="f")
    assert sorted(json.dumps(r, sort_keys=True) for r in again) == sorted(json.dumps(r, sort_keys=True) for r in recs)
    table = passkey.accuracy_table(again)
    assert list(table) == [300] and set(table[300]) == {0.0, 1.0}


def test_default_lengths_fit_the_prompt(tiny):
    tok = tiny.tokenizer  # byte level: the fixed text alone is ~250 tokens
    assert passkey.default_lengths(tok, 4096) == [1024, 2048, 4088]
    assert passkey.default_lengths(tok, 512) == [504]  # 128 and 256 are too short
    with pytest.raises(ValueError, match="max_position_embeddings=256 is too short"):
        passkey.default_lengths(tok, 256)


def test_agnostic_protocol_splits_the_same_ids(tiny, tmp_path):
    """--protocol agnostic compresses the prompt without its question, then extends the cache with the
    question's ids: under a full cache nothing is dropped either way, so every answer equals the
    question-aware one (the same token ids, split at the question)."""
    args = (tiny.model, tiny.tokenizer, FullCache(), [300], [0.0, 0.5, 1.0], 1)
    aware = passkey.run(*args, ResultLog(tmp_path / "a.jsonl"), progress=False, label="f")
    agnostic = passkey.run(*args, ResultLog(tmp_path / "b.jsonl"), progress=False, label="f", protocol="agnostic")
    assert [r["output"] for r in agnostic] == [r["output"] for r in aware]


def _held_cell(table: str, section: str, length: int) -> str:
    """The "KV held" cell (the last) of `length`'s row in the markdown table under `### section`."""
    rows = table.split(f"### {section}\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert rows[1].endswith("| mean | KV held |"), rows[1]
    return next(r for r in rows if r.startswith(f"| {length} |")).split("|")[-2].strip()


def test_records_hold_kv_held_and_a_record_without_it_shows_blank(tiny_dir, tmp_path):
    """Each record's `kv_held` is the share of the full cache's KV bytes its prompt held (the full cache all of it,
    StreamingLLM at budget 32 its 32 slots of the 300-token prompt); the table's "KV held" column is the length's
    mean, the summary's "kv_held" too, beside the accuracy tables it leaves as they were. A record from before the
    field is not recomputed: its length's cell is blank (None in the summary), never 0."""
    from kvjax.experiments import driver

    lm = driver.load_model(tiny_dir)
    pols = driver.resolve_policies("full,streaming", budget=32)
    full, stream = pols["full"].describe(), pols["streaming"].describe()
    out = tmp_path / "pk"
    res = passkey.suite(lm, pols, out, lengths=[300], depths=[0.0, 1.0], samples=1, progress=False)
    path = out / "samples.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(recs) == 4 and all(0 < r["kv_held"] <= 1 for r in recs)
    assert [r["kv_held"] for r in recs if r["policy"] == full] == [1.0, 1.0]
    assert [r["kv_held"] for r in recs if r["policy"] == stream] == [round(32 / 300, 6)] * 2
    assert res.summary["kv_held"] == {full: {"300": 1.0}, stream: {"300": round(32 / 300, 4)}}
    assert set(res.summary[full]) == {"300"} and set(res.summary[full]["300"]) == {"0.0", "1.0"}
    assert _held_cell(res.table, full, 300) == "1.0000"
    assert _held_cell(res.table, stream, 300) == f"{32 / 300:.4f}"
    # a record written before the field: kept as it is, its length's cell blank
    old = [r if r["policy"] != stream or r["depth"] != 1.0 else {k: v for k, v in r.items() if k != "kv_held"}
           for r in recs]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    again = passkey.suite(lm, pols, out, lengths=[300], depths=[0.0, 1.0], samples=1, progress=False)
    assert [json.loads(line) for line in path.read_text().splitlines()] == old  # nothing recomputed
    assert _held_cell(again.table, stream, 300) == "" and _held_cell(again.table, full, 300) == "1.0000"
    assert again.summary["kv_held"] == {full: {"300": 1.0}, stream: {"300": None}}
    assert again.summary[stream] == res.summary[stream]
