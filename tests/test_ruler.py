"""RULER (issue #24): samples checked against RULER's rules for two tokenizers, scoring against a
transcription of RULER's functions, and the suite end to end on the default model."""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pytest

from kvjax.experiments import cli
from kvjax.experiments.ruler import __main__ as ruler_cli
from kvjax.experiments.ruler import scoring
from kvjax.experiments.ruler import tasks as T
from kvjax import FullCache, generate, kept_positions
from kvjax.policies import SnapKV
from kvjax.models import load_default


@pytest.fixture(scope="module")
def default():
    return load_default()


def word_tokenizer():
    """A word-level tokenizer (one id per whitespace-separated word) built here: RULER's lengths must
    hold for any tokenizer, not only the default model's BPE."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")


@pytest.fixture(scope="module", params=["bpe", "word"])
def count(request, default):
    return T.token_counter(default.tokenizer if request.param == "bpe" else word_tokenizer())


# Lengths at which every task fits each tokenizer (the default BPE has 512 tokens: English costs more).
def length_for(count, task: str) -> int:
    bpe = count("The grass is green.") > 6
    return {"niah": 2048 if bpe else 1024, "variable_tracking": 2048 if bpe else 1024,
            "common_words_extraction": 3000 if bpe else 1500, "freq_words_extraction": 1024}[T.TASKS[task].kind]


# ---- RULER's text, as RULER produces it ----


def test_niah_singular_template_and_needle_verbatim(count):
    s = T.generate("niah_single_1", length_for(count, "niah_single_1"), 2, count)[1]
    key = re.search(r"What is the special magic number for (\S+) mentioned", s.question).group(1)
    assert s.input.startswith("A special magic number is hidden within the following text. Make sure to memorize "
                              "it. I will quiz you about the number afterwards.\n")
    assert s.question == f"What is the special magic number for {key} mentioned in the provided text?"
    assert s.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    assert s.context + s.question == s.input
    assert f"One of the special magic numbers for {key} is: {s.outputs[0]}." in s.input
    adj, noun = key.split("-", 1)
    from wonderwords.random_word import _get_words_from_text_file as words

    assert adj in words("adjectivelist.txt") and noun in words("nounlist.txt")
    assert re.fullmatch(r"\d{7}", s.outputs[0])
    lines = s.context.split("\n")[1:-1]  # after the instruction line, before the question
    assert set(lines) == {T.NOISE, f"One of the special magic numbers for {key} is: {s.outputs[0]}."}


def test_plural_template_for_multivalue():
    s = T.generate("niah_multivalue_stdlib", 4096, 1, lambda text: len(text.split()))[0]
    assert s.input.startswith("Some special magic numbers are hidden within the following text.")
    assert s.question.startswith("What are all the special magic numbers for ")
    assert s.answer_prefix.endswith("mentioned in the provided text are") and len(s.outputs) == 4


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_2", "niah_multikey_3"])
def test_niah_each_key_and_value_once(task, count):
    for s in T.generate(task, length_for(count, task), 3, count):
        key = re.search(r"special magic \w+ for (\S+) mentioned", s.question).group(1)
        assert s.context.count(key) == 1 and s.context.count(s.outputs[0]) == 1
        if task != "niah_single_1":  # needle haystack: every line is a needle, one of them the real one
            assert all(line.startswith("One of the special magic") for line in s.context.split("\n")[1:-1])
        if task == "niah_multikey_3":
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", s.outputs[0])


def test_vt_chain_complete_and_consistent(count):
    for s in T.generate("vt", length_for(count, "vt"), 3, count):
        value = re.search(r"assigned the value (\d+) in the text above", s.question).group(1)
        assert s.answer_prefix == (" Answer: According to the chain(s) of variable assignment in the text above, "
                                   f"5 variables are assigned the value {value}, they are: ")
        main = s.context[s.context.rindex("Memorize and track"):]  # after the one-shot example
        names = list(s.outputs)
        assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
        assert f"VAR {names[0]} = {value}" in main
        for a, b in zip(names, names[1:]):
            assert f"VAR {b} = VAR {a}" in main
        order = [main.index(f"VAR {n} =") for n in names]
        assert order == sorted(order)  # inserted in chain order
        # The one-shot example: a complete chain of three-letter names with its answer, value renamed from 12345.
        example = s.context[: s.context.rindex("Memorize and track")]
        assert example.startswith("Memorize and track") and "12345" not in example
        shown = example.strip().split()[-5:]
        assert all(re.fullmatch(r"[A-Z]{3}", n) for n in shown)


@pytest.mark.parametrize("long", [False, True])
def test_cwe_counts(long, count):
    # Below 4K: common words x 6, the others x 1; at 4K and above: x 30 and x 3.
    bpe = count("The grass is green.") > 6
    length = (8192 if bpe else 4096) if long else length_for(count, "cwe")
    common, uncommon = (30, 3) if long else (6, 1)
    s = T.generate("cwe", length, 1, count)[0]
    assert s.question == "Question: What are the 10 most common words in the above list?"
    assert s.answer_prefix == " Answer: The top 10 words that appear most often in the list are:"
    main = s.context[s.context.rindex("Below is a numbered list"):]
    assert main.startswith("Below is a numbered list of words. In these words, some appear more often than others. "
                           "Memorize the ones that appear most often.\n1. ")
    listed = re.findall(r"\d+\. (\S+)", main)
    freq = Counter(listed)
    assert sorted(freq[w] for w in s.outputs) == [common] * 10
    assert {c for w, c in freq.items() if w not in s.outputs} == {uncommon}
    assert [int(n) for n in re.findall(r"(\d+)\. ", main)] == list(range(1, len(listed) + 1))
    # The few-shot example before it, answered: 40 words (10 x 10 + 30 x 3) at 4K and above, 20 below.
    example = s.context[: s.context.rindex("Below is a numbered list")]
    listed = re.findall(r"\d+\. (\S+)", example.split("Question")[0])
    assert len(listed) == (10 * 10 + 30 * 3 if long else 10 * 3 + 10 * 1)
    top = [w for w, _ in Counter(listed).most_common(10)]
    assert example.rstrip("\n").endswith(" ".join(f"{i + 1}. {w}" for i, w in enumerate(
        re.findall(r"\d+\. (\S+)", example.split("are:")[-1]))))
    assert set(re.findall(r"\d+\. (\S+)", example.split("are:")[-1])) == set(top)


def test_fwe_counts_follow_zeta(count):
    for s in T.generate("fwe", 1024, 2, count):
        assert s.context.startswith("Read the following coded text and track the frequency of each coded word. Find "
                                    "the three most frequently appeared coded words. ")
        assert s.question == ("Question: Do not provide any explanation. Please ignore the dots '....'. What are the "
                              "three most frequently appeared words in the above coded text?")
        assert s.answer_prefix == (" Answer: According to the coded text above, the three most frequently appeared "
                                   "words are:")
        coded = s.context[s.context.index("coded words. ") + len("coded words. "):].split()
        freq = Counter(coded)
        ranked = [w for w, _ in freq.most_common()]
        assert ranked[0] == "..." and list(s.outputs) == ranked[1:4]
        n = len(coded)
        # int(N k^-2 / zeta(2)) for rank k: recover N from the total, then check every rank's count.
        counts = sorted(freq.values(), reverse=True)
        vocab = (1024 - 50) // 50
        for big_n in range(n, 2 * n):
            if int(np.sum((big_n * np.arange(1, vocab + 1) ** -2.0 / (np.pi ** 2 / 6)).astype(int))) == n:
                break
        want = (big_n * np.arange(1, vocab + 1) ** -2.0 / (np.pi ** 2 / 6)).astype(int)
        assert counts == [int(c) for c in want if c > 0]


@pytest.mark.parametrize("length", [1024, 4096])
def test_fwe_vocabulary_is_ruler_s_draw_of_the_prompt_s_room(length, count):
    """RULER draws FWE's coded vocabulary with `random.choices` from `random.seed(42)`, (max_seq_length -
    tokens_to_generate) // 50 words (since it fits input + generation), once for its fitting and once per
    sample, sorted, shuffled by a fresh `random.Random(42)`, rank 0 the noise `...`; the answer is ranks
    1-3. Transcribed here, the answers must be those of the right vocabulary size (RULER's old
    max_seq_length // 50 draws other words)."""
    import random
    import string

    rng = random.Random(42)

    def vocab(n):
        words = ["".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(n)]
        while len(set(words)) < n:
            words.append("".join(rng.choices(string.ascii_lowercase, k=6)))
        words = sorted(set(words))
        random.Random(42).shuffle(words)
        return ["..."] + words[1:]

    size = (length - 50) // 50
    vocab(size)  # the fitting's draw
    for s in T.generate("fwe", length, 2, count):
        assert list(s.outputs) == vocab(size)[1:4]


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_2", "vt", "fwe"])
def test_lengths_fit_and_are_within_one_step(task, count):
    length = length_for(count, task)
    for s in T.generate(task, length, 3, count):
        assert s.length == count(s.prompt) + T.TASKS[task].tokens_to_generate <= length
        # One more haystack step would not fit: RULER's steps are 5 lines (noise, needles) below 4K,
        # 5 lines for VT, 1/32 of the room for FWE.
        if task == "fwe":  # steps of room // 32 words; each sample draws a new vocabulary after the fitting
            coded = s.context.split("coded words. ", 1)[1].split()
            step = 2 * ((length - 50) // 32) * count(s.context) / len(coded)
        else:
            step = 5 * count((T.NOISE if task != "niah_multikey_2" else
                              "One of the special magic numbers for tasty-cake is: 1234567.") + "\n")
        assert length - s.length < step + 8, (length, s.length, step)


def test_cwe_beyond_wonderwords_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cwe needs \d+ distinct words .* wonderwords has 8166"):
        T.generate("cwe", 131072, 1, lambda text: len(text.split()))


def test_seeded_and_the_same_first_samples():
    count = T.token_counter(word_tokenizer())
    a = T.generate("niah_single_1", 1024, 3, count)
    assert [s.prompt for s in T.generate("niah_single_1", 1024, 2, count)] == [s.prompt for s in a[:2]]
    assert a[0].prompt != T.generate("niah_single_1", 1024, 1, count, seed=7)[0].prompt


# ---- scoring, against a transcription of RULER's functions ----


def ruler_postprocess_pred(predict_str):  # scripts/eval/evaluate.py
    predict_str = predict_str.strip()
    np_pattern = re.compile(r"[\x00-\x1f]")
    return np_pattern.sub("\n", predict_str).strip()


def ruler_string_match_all(preds, refs):  # scripts/eval/synthetic/constants.py
    score = sum([sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref)
                 for pred, ref in zip(preds, refs)]) / len(preds) * 100
    return round(score, 2)


def ruler_string_match_part(preds, refs):
    score = sum([max([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) for pred, ref in zip(preds, refs)]) \
        / len(preds) * 100
    return round(score, 2)


@pytest.mark.parametrize("preds,refs", [
    ([""], [["1234567"]]),                                              # empty prediction
    (["  The NUMBER is 1234567.\x00\n"], [["1234567"]]),                 # control characters, spaces
    (["Heavy-Cake and light"], [["heavy-cake", "light", "dark"]]),       # case; partial: 2 of 3
    (["123456"], [["1234567"]]),                                         # a prefix is not a match
    (["a b c", "x"], [["a", "z"], ["x", "y", "w", "v"]]),                # mean over samples
    (["ab\x1fcd", "abcd"], [["abcd"], ["bc"]]),                          # a control char breaks a match
])
def test_scoring_equals_rulers(preds, refs):
    ours = [scoring.postprocess(p) for p in preds]
    theirs = [ruler_postprocess_pred(p) for p in preds]
    assert ours == theirs
    assert scoring.string_match_all(ours, refs) == ruler_string_match_all(theirs, refs)
    assert scoring.string_match_part(ours, refs) == ruler_string_match_part(theirs, refs)


# ---- the protocols ----


def test_agnostic_kept_positions_do_not_depend_on_the_question(default):
    tok = default.tokenizer
    s = T.generate("niah_single_1", 2048, 1, T.token_counter(tok))[0]
    ctx = tok(s.context)["input_ids"][-300:]
    questions = [tok(q, add_special_tokens=False)["input_ids"] for q in
                 (s.question + s.answer_prefix, " What was the first sentence? It was")]
    out = generate(default.model, [ctx, ctx], SnapKV(budget=64, observation_window=16), max_new_tokens=4, questions=questions)
    for layer in kept_positions(out.cache):
        layer = np.asarray(layer)
        of_context = [[sorted(p[(p >= 0) & (p < len(ctx))].tolist()) for p in row] for row in layer]
        assert of_context[0] == of_context[1] and len(of_context[0][0]) == 64


def test_agnostic_equals_aware_under_the_full_cache(default):
    tok = default.tokenizer
    ctx = tok("The pass key is 54321. Remember it. " + "The grass is green. " * 10)["input_ids"]
    q = tok(" What is the pass key? The pass key is", add_special_tokens=False)["input_ids"]
    aware = generate(default.model, [ctx + q], FullCache(), max_new_tokens=6)
    agnostic = generate(default.model, [ctx], FullCache(), max_new_tokens=6, questions=[q])
    assert aware.sequences() == agnostic.sequences()


# ---- the suite on the default model: run, resume, identity ----


def test_cli_on_the_default_model_resumes_and_refuses_another_identity(tmp_path, capsys, monkeypatch):
    out = tmp_path / "ruler"
    argv = ["--tasks", "niah_single_1,fwe", "--max-new-tokens", "16", "--samples", "2", "--batch", "1",
            "--compare", "full,streaming,snapkv", "--budget", "128", "--observation-window", "16", "--out", str(out)]
    calls = []  # one entry per (sample, policy) predicted
    real = ruler_cli.generate_many

    def killed_after_three(model, prompts, policies, **k):
        if len(calls) == 3:
            raise KeyboardInterrupt  # the run is killed here (Ctrl-C: one line, exit 130)
        calls.extend([1] * len(prompts) * len(policies))
        return real(model, prompts, policies, **k)

    monkeypatch.setattr(ruler_cli, "generate_many", killed_after_three)
    assert cli.run(ruler_cli.main, argv) == 130
    assert len((out / "preds.jsonl").read_text().splitlines()) == 3  # the first sample under the three policies
    monkeypatch.setattr(ruler_cli, "generate_many",
                        lambda model, prompts, policies, **k: calls.extend([1] * len(prompts) * len(policies))
                        or real(model, prompts, policies, **k))
    assert cli.run(ruler_cli.main, argv) == 0
    assert len(calls) == 3 + (2 * 3 * 2 - 3)  # the rerun computes only what the kill left
    result = json.loads((out / "results.json").read_text())
    assert set(result["scores"]) == {"full", "streaming", "snapkv"}
    assert set(result["scores"]["full"]) == {"niah_single_1", "fwe"}
    md = (out / "results.md").read_text()
    assert "| full | 512 |" in md and (out / "score_vs_length.png").is_file()
    data = (out / "data" / "niah_single_1-512.jsonl").read_text().splitlines()
    assert len(data) == 2 and json.loads(data[0])["length"] <= 512
    capsys.readouterr()
    assert cli.run(ruler_cli.main, argv + ["--protocol", "aware"]) == 2
    assert "--protocol: 'agnostic' -> 'aware'" in capsys.readouterr().err


def test_cli_ratios_sweep_and_task_that_does_not_fit(tmp_path, capsys):
    out = tmp_path / "ratios"
    argv = ["--tasks", "niah_single_1", "--max-new-tokens", "8", "--samples", "1", "--compare", "full,snapkv,streaming",
            "--ratios", "0.5,0.75", "--observation-window", "8", "--out", str(out)]
    assert cli.run(ruler_cli.main, argv) == 0
    result = json.loads((out / "results.json").read_text())
    assert set(result["scores"]) == {"full", "snapkv@0.5", "snapkv@0.75", "streaming@0.5", "streaming@0.75"}
    assert "ratio=0.5" in result["policies"]["snapkv@0.5"]
    # StreamingLLM has a ratio mode too now: each row keeps floor(n * (1 - ratio)) of its prompt
    assert result["policies"]["streaming@0.75"].startswith("StreamingLLM(budget=None, sinks=4, ratio=0.75,")
    assert (out / "score_vs_ratio.png").is_file()
    # every record says the share of the full cache's KV bytes it held; the full cache all of it
    records = [json.loads(line) for line in (out / "preds.jsonl").read_text().splitlines()]
    assert all(0 < r["kv_held"] <= 1 for r in records)
    assert result["kv_held"]["full"] == {"512": 1.0} and result["kv_held"]["snapkv@0.75"]["512"] < 0.5
    capsys.readouterr()
    code = cli.run(ruler_cli.main, ["--tasks", "vt", "--out", str(tmp_path / "vt")])
    err = capsys.readouterr().err
    assert code == 2 and "vt does not fit in 512 tokens" in err and "pass --tasks without vt" in err


def test_leaderboard_preset_mirrors_kvpress():
    _, args = ruler_cli.parse(["--preset", "leaderboard"])
    assert args.ratios == (0.25, 0.5, 0.75, 0.875, 0.9375, 0.96875)  # to 16:1 and 32:1 (issue 63)
    names = args.compare.split(",")
    assert {"full", "streaming", "snapkv", "pyramidkv", "tova", "knorm", "h2o-prefill"} <= set(names)  # kvpress's
    assert {"mat", "slimkv"} <= set(names) and "razor" not in names  # razor needs --heads
    _, args = ruler_cli.parse(["--preset", "leaderboard", "--heads", "heads.json"])
    assert "razor" in args.compare.split(",")
    with pytest.raises(SystemExit):
        ruler_cli.parse(["--preset", "leaderboard", "--compare", "full"])


# ---- QA (qa_1 SQuAD, qa_2 HotpotQA), read from a local data directory ----


@pytest.fixture(scope="module")
def qa_dir(tmp_path_factory):
    from tests.ruler_qa_data import write

    d = tmp_path_factory.mktemp("qa")
    write(d)
    return d


@pytest.mark.parametrize("name,dataset", [("qa_1", "squad"), ("qa_2", "hotpotqa")])
@pytest.mark.parametrize("length", [1500, 2600])
def test_qa_samples_equal_rulers_own_generator(default, qa_dir, name, dataset, length):
    """RULER's qa.py on the same files and tokenizer (counting `tokenizer.tokenize`, as RULER does) wrote
    tests/data/ruler_qa/*.jsonl: kvjax's samples are the same, byte for byte."""
    from pathlib import Path

    ref = [json.loads(line) for line in
           (Path(__file__).parent / "data" / "ruler_qa" / f"{dataset}-{length}.jsonl").read_text().splitlines()]
    got = T.generate(name, length, len(ref), lambda text: len(default.tokenizer.tokenize(text)), data_dir=qa_dir)
    assert [(s.input, list(s.outputs), s.length, s.answer_prefix) for s in got] == \
        [(r["input"], r["outputs"], r["length"], r["answer_prefix"]) for r in ref]
    for s in got:  # kvpress's split: the question starts at the last instruction
        assert s.context + s.question == s.input and s.answer_prefix == " Answer:"
        assert s.question.startswith("Answer the question based on the given documents.") and "Question: " in s.question


def test_qa_reads_rulers_formats(qa_dir):
    qas, docs = T.read_qa(T.TASKS["qa_1"], qa_dir)
    assert len(qas) == 6 * 3 * 2 and len(docs) == 18  # unanswerable questions skipped, a shared paragraph once
    # the other paragraphs of the article: 2, or 3 in the article that also holds a shared one
    assert docs == sorted(docs) and sorted(len(q["more"]) for q in qas) == [2] * 30 + [3] * 6
    qas, docs = T.read_qa(T.TASKS["qa_2"], qa_dir)
    assert len(qas) == 8 and all(len(q["context"]) == 4 and q["more"] == [] for q in qas)
    with pytest.raises(T.InvalidInput, match="--data-dir DIR with squad.json"):
        T.read_qa(T.TASKS["qa_1"], None)


def test_qa_scores_any_reference_the_others_every_reference():
    assert scoring.sample_score("it was Paris", ["Paris", "Lyon"], "part") == 1.0
    assert scoring.sample_score("it was Paris", ["Paris", "Lyon"], "all") == 0.5
    assert T.METRICS["qa"] == "part" and T.METRICS["niah"] == "all"


def test_qa_without_its_data_is_said_not_run(default, tmp_path, capsys):
    with pytest.raises(SystemExit):
        ruler_cli.parse(["--tasks", "niah_single_1", "--data-dir", str(tmp_path)])
    assert "--data-dir" in capsys.readouterr().err
    code = cli.run(ruler_cli.main, ["--tasks", "qa_1,qa_2", "--compare", "full", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "no task to run: qa_1 (its squad file" in err and "qa_2 (its hotpotqa file" in err


def test_table_has_the_kv_held_column_and_old_records_show_it_blank(tmp_path):
    rows = [{"label": lab, "task": "niah_single_1", "length": 512, "index": i, "pred": "7", "outputs": ["7"],
             **({} if held is None else {"kv_held": held})}
            for lab, helds in (("full", (1.0, 1.0)), ("duo@0.5", (0.6, 0.7)), ("snapkv@0.5", (0.5, None)))
            for i, held in enumerate(helds)]
    meta = {"model": "m", "protocol": "agnostic", "samples": 2, "seed": 0, "not_run": [],
            "policies": {"full": "FullCache()", "duo@0.5": "DuoAttention(...)", "snapkv@0.5": "SnapKV(...)"}}
    md, summary, figures = ruler_cli.write_report(tmp_path, rows, meta)
    lines = md.splitlines()
    assert "| policy | length | KV held | niah_single_1 | average |" in lines
    assert "| duo@0.5 | 512 | 0.6500 | 100.00 | **100.00** |" in lines  # DuoAttention on its bytes
    assert "| snapkv@0.5 | 512 |  | 100.00 | **100.00** |" in lines  # a record without the field: blank
    assert summary["kv_held"] == {"full": {"512": 1.0}, "duo@0.5": {"512": 0.65}, "snapkv@0.5": {"512": None}}
    assert (tmp_path / "results.csv").read_text().splitlines()[0].startswith("policy,length,kv_held,")
    assert tmp_path / "score_vs_ratio.png" in figures
