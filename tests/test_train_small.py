"""kvjax-small's training data: suite prompts in their own templates, with answers the suites score 1."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax.experiments.longbench.harness import config
from kvjax.experiments.longbench.metrics import sample_score
from kvjax.experiments.ruler.scoring import sample_match_all
from kvjax.experiments.tasks import Mixture, RowSampler
from kvjax.experiments.train_small import ntk_theta, suite_examples, suite_prompts
from kvjax.errors import NonFiniteError
from kvjax.models import DEFAULT_DIR

pytestmark = pytest.mark.skipif(not (DEFAULT_DIR / "tokenizer.json").is_file(), reason="no default tokenizer")


@pytest.fixture(scope="module")
def tok():
    from kvjax.models.loading import load_tokenizer

    return load_tokenizer(DEFAULT_DIR)


def test_every_trained_answer_scores_full_marks_under_its_suites_metric(tok):
    examples = list(suite_examples(tok, 1024, 2, seed=5))
    seen = {name for name, *_ in examples}
    assert {"stdlib_passkey", "stdlib_qa", "stdlib_marker_count", "stdlib_paragraph_kv", "niah_single_1",
            "fwe"} <= seen
    cfg = config()
    for name, prompt, answer, refs in examples:
        if name.startswith("stdlib_"):
            template = cfg["prompts"][name]
            assert prompt.startswith(template.split("{")[0])  # LongBench's template, verbatim
            assert sample_score(name, cfg["metrics"][name], answer, refs, None) == 1.0, (name, answer, refs)
        else:
            assert sample_match_all(answer, refs) == 1.0
    ids = suite_prompts(tok, 1024, 1, seed=5)
    assert all(a[-1] == tok.eos_token_id for _, a in ids)


def test_suite_rows_open_with_the_prompt_and_weigh_its_answer(tok):
    rng = np.random.default_rng(0)
    code = docs = np.arange(4, 400, dtype=np.int32).repeat(50)
    prompts = [([7] * 150, [8, 9, 2]), ([5] * 300, [6, 2])]
    s = RowSampler(tok, code, docs, 512, mixture=Mixture(text=0, passkey=0, kv=0, facts=0, copy=0, induction=0,
                                                         suite=1.0), answer_weight=4.0, prompts=prompts)
    ids, w = s.row(rng, 200)  # only the 153-token prompt fits a 200-token span
    assert ids[0] == tok.bos_token_id and ids[1:151].tolist() == [7] * 150 and ids[151:154].tolist() == [8, 9, 2]
    assert w[151:154].tolist() == [4.0] * 3 and w[:151].max() == 1.0 and w[154:].max() == 1.0
    ids, _ = s.row(rng, 140)  # no suite prompt fits: the passkey task, whose fixed text is the shortest
    assert "pass key" in tok.decode(ids)


def test_ntk_theta_stretches_the_slowest_rotation_by_the_scale():
    d, scale = 32, 4.0
    theta = ntk_theta(10000.0, scale, d)
    slowest = lambda base: base ** (-(d - 2) / d)  # noqa: E731  (the last RoPE frequency)
    assert slowest(10000.0) / slowest(theta) == pytest.approx(scale)


def test_batches_route_each_step_to_its_stage():
    """Steps [0, short) draw short rows, [short, short + long) long rows, and the optional extension the rest;
    without an extension the long stage's sampler serves every later step."""
    import argparse

    from kvjax.experiments.train_small import batches

    class Rows:  # a sampler whose rows say which stage drew them
        def __init__(self, mark, seq_len):
            self.mark, self.seq_len = mark, seq_len

        def row(self, rng, span):
            return np.full(self.seq_len, self.mark, np.int32), np.ones(self.seq_len, np.float32)

    args = argparse.Namespace(seed=0, short_steps=2, long_steps=3, short_batch=4, long_batch=2)
    short, long, extend = Rows(1, 8), Rows(2, 16), Rows(3, 16)
    with_ext, without = batches(args, long, short, 4, extend), batches(args, long, short, 4)
    marks = [(int(b["tokens"][0, 0]), b["tokens"].shape) for b in map(with_ext, range(7))]
    assert marks == [(1, (4, 8))] * 2 + [(2, (2, 16))] * 3 + [(3, (2, 16))] * 2
    assert [int(without(i)["tokens"][0, 0]) for i in range(7)] == [1, 1, 2, 2, 2, 2, 2]


def test_extension_draws_spans_from_the_upper_half_of_the_context():
    """The long stage's task spans start at the shortest task; the extension's at half the row, so keys far
    before their question (passkey at depth 0 of a full context) are common there."""
    import argparse

    from kvjax.experiments.train_small import batches

    class Rows:
        def __init__(self, seq_len):
            self.seq_len, self.spans = seq_len, []

        def row(self, rng, span):
            self.spans.append(span)
            return np.zeros(self.seq_len, np.int32), np.ones(self.seq_len, np.float32)

    args = argparse.Namespace(seed=0, short_steps=1, long_steps=200, short_batch=1, long_batch=1)
    short, long, extend = Rows(512), Rows(2048), Rows(2048)
    batch = batches(args, long, short, 140, extend)
    for i in range(1, 401):
        batch(i)
    assert min(long.spans) < 1024 <= min(extend.spans) and max(extend.spans) <= 2047 and len(extend.spans) == 200


def test_from_takes_the_base_models_recorded_training_and_continues_its_rows(tmp_path):
    """`--from DIR` continues DIR's recorded run: its seed, stages and layers (so the extension draws the rows
    the whole run with --extend-steps would), this call's extension options."""
    import json

    from kvjax.experiments.train_small import continued, parse
    from kvjax.errors import MissingFile

    base = {"command": "python -m kvjax.experiments.train_small --layers 6", "train_minutes": 77.0,
            "args": vars(parse(["--out", "models/small", "--layers", "6", "--short-steps", "1500", "--long-steps", "700",
                                "--seed", "3"]))}
    (tmp_path / "eval.json").write_text(json.dumps({"training": base}))
    args, record = continued(parse(["--from", str(tmp_path), "--out", "/x", "--extend-steps", "9"]))
    assert (args.layers, args.short_steps, args.long_steps, args.seed) == (6, 1500, 700, 3)
    assert (args.out, args.extend_steps, args.from_) == ("/x", 9, str(tmp_path)) and record == base
    with pytest.raises(MissingFile, match="no eval.json"):
        continued(parse(["--from", str(tmp_path / "none"), "--out", "/x", "--extend-steps", "9"]))
    assert args.extend_offset == 0
    # an extended model (here by 5 steps after 4 earlier ones) goes on with the rows after its extension's
    base["args"].update(extend_steps=5, extend_offset=4)
    (tmp_path / "eval.json").write_text(json.dumps({"training": base}))
    args, _ = continued(parse(["--from", str(tmp_path), "--out", "/x", "--extend-steps", "9"]))
    assert (args.extend_offset, args.extend_steps) == (9, 9)
    with pytest.raises(SystemExit):
        parse(["--from", str(tmp_path), "--out", "/x"])


def test_the_card_names_each_extension_and_the_chain_that_reproduces_the_weights(tmp_path):
    from kvjax.experiments.small_card import final_loss, training_chain

    def run(command, out, **args):
        return {"command": command, "args": {"out": out, "long_batch": 2, **args}}

    first = run("python -m kvjax.experiments.train_small", "models/small")
    ext1 = {**run("train_small --from models/small --out A --extend-steps 450", "A", extend_steps=450,
                  extend_lr=5e-4, from_="models/small"), "base": first}
    ext2 = {**run("train_small --from A --out B --extend-steps 400 --extend-lr 3e-4", "B", extend_steps=400, from_="A",
                  extend_lr=3e-4, extend_mixture="kv=0.5,suite=0.5", extend_kv_queries=16, extend_fact_queries=0),
            "base": ext1}
    commands, words = training_chain(ext2, tmp_path / "small", 2048)
    assert commands[:3] == [first["command"], ext1["command"], ext2["command"]]
    assert commands[3].startswith("# then copy B/{config.json,model.safetensors} into ")  # the card is elsewhere
    # a record from before --extend-mixture trained on the default extension rows (text 0.1, ..., suite 0.5)
    assert words.startswith(", then 850 more steps of 2 x 2048-token rows in 2 extensions (450 from lr 0.0005 on "
                            "rows text=0.1,passkey=0.1,kv=0.1,facts=0.05,copy=0.05,induction=0.1,suite=0.5; "
                            "400 from lr 0.0003 on rows kv=0.5,suite=0.5 with 16 key-value questions per row),")
    assert training_chain(ext1, "A", 2048)[0] == [first["command"], ext1["command"]]  # written where it trained
    adopted = {**run("train_small --from models/small --out C --extend-steps 9", "C", extend_steps=9, extend_lr=5e-4,
                     from_="models/small"), "base": ext2}  # B was copied into models/small before this run
    assert training_chain(adopted, "C", 2048)[0][3:5] == [
        "# then copy B/{config.json,model.safetensors} into models/small", adopted["command"]]
    assert " 450 more steps of 2 x 2048-token rows from lr 0.0005 on rows text=0.1," in training_chain(ext1, "A", 2048)[1]
    assert training_chain(first, "models/small", 2048) == ([first["command"]], "")
    titled = {**run("train_small --from B --out D --extend-steps 5", "D", extend_steps=5, from_="B", extend_lr=5e-4,
                    extend_mixture="titles=0.5,counts=0.2,kv=0.3", extend_kv_queries=16), "base": ext2}
    assert training_chain(titled, "D", 2048)[1].endswith(
        "(450 from lr 0.0005 on rows text=0.1,passkey=0.1,kv=0.1,facts=0.05,copy=0.05,induction=0.1,suite=0.5; "
        "400 from lr 0.0003 on rows kv=0.5,suite=0.5 with 16 key-value questions per row; 5 from lr 0.0005 on rows "
        "titles=0.5,counts=0.2,kv=0.3 with 16 key-value and 8 title (4-15 titled paragraphs) and 2-4 count (sounds) "
        "questions per row), suite prompts drawn from twice the prompt pool (a second seed), each task spanning the "
        "upper half of the row")

    # one step's loss is one batch's: the card gives the mean of the last 50 when the curve is kept
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "loss.json").write_text(
        json.dumps([{"step": i, "loss": 9.0 if i < 10 else 1.0 + (i % 2)} for i in range(60)]))
    assert final_loss(tmp_path, {"final_loss": 2.0}) == "1.500 (mean of the last 50 steps)"
    assert final_loss(tmp_path / "none", {"final_loss": 2.0}) == "2.000 (the last step's batch)"
    # a clone has no curve: the last card's words stand, the kept text before the last step's batch
    assert final_loss(tmp_path / "none", {"final_loss": 2.0}, kept="1.5 (kept)") == "1.5 (kept)"
    assert final_loss(tmp_path, {"final_loss": 2.0}, kept="1.5 (kept)") == "1.500 (mean of the last 50 steps)"
    # a diverged run's loss is an error, never a number in the card
    (tmp_path / "training" / "loss.json").write_text(json.dumps([{"step": 0, "loss": float("nan")}]))
    with pytest.raises(NonFiniteError, match="diverged"):
        final_loss(tmp_path, {"final_loss": 2.0})
    with pytest.raises(NonFiniteError, match="the last step's batch"):
        final_loss(tmp_path / "none", {"final_loss": float("inf")})


def _kv_table_and_questions(text: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """A decoded key-value row read back by regex: its table {key: value} and its (asked key, answer) pairs."""
    import re

    table = dict(re.findall(r"^(\d{4}): (\d{5})$", text, re.M))
    asked = re.findall(r"The value of key (\d{4}) is (\d{5})\.", text)
    return table, asked


@pytest.mark.parametrize("queries", [0, 16])
def test_kv_rows_ask_their_questions_on_their_own_table(tok, queries):
    """kv_queries=0 (the committed model's rows): the table fills the span and 1-3 distinct keys are asked;
    N > 0 (the --extend-kv-queries stage): a table of 4-199 lines and N questions, every answer the value its
    key has in the table, every answer token weighed answer_weight."""
    code = docs = np.arange(4, 400, dtype=np.int32).repeat(50)
    s = RowSampler(tok, code, docs, 2048, mixture=Mixture(text=0, passkey=0, kv=1, facts=0, copy=0, induction=0),
                   answer_weight=4.0, kv_queries=queries)
    sizes = []
    for seed in range(6):
        ids, w = s.row(np.random.default_rng(seed), 1500)
        table, asked = _kv_table_and_questions(tok.decode(ids[ids != tok.bos_token_id]))
        assert asked and all(table[k] == v for k, v in asked), (table, asked)
        assert (w == 4.0).sum() == sum(len(s.encode(f" {v}.\n")) for _, v in asked)
        if queries:
            assert len(asked) == queries and 4 <= len(table) < 200
        else:
            assert 1 <= len(asked) <= 3 and len(set(asked)) == len(asked)
            assert len(table) > 1400 // len(s.encode("1234: 56789\n")) - 8  # the table fills the span
        sizes.append(len(table))
    assert queries == 0 or len(set(sizes)) > 1  # table sizes vary


@pytest.mark.parametrize("queries", [0, 8])
def test_fact_rows_ask_about_facts_their_text_states(tok, queries):
    """fact_queries=0 (the committed model's rows): 1-3 facts in text and one question; N > 0 (the
    --extend-fact-queries stage): 3-16 facts, no (attribute, subject) twice, and N questions, each answered
    with the value the text states for it."""
    import re

    code = docs = np.arange(4, 400, dtype=np.int32).repeat(50)
    s = RowSampler(tok, code, docs, 2048, mixture=Mixture(text=0, passkey=0, kv=0, facts=1, copy=0, induction=0),
                   answer_weight=4.0, fact_queries=queries)
    for seed in range(6):
        ids, w = s.row(np.random.default_rng(seed), 1500)
        text = tok.decode(ids[ids != tok.bos_token_id])
        stated = re.findall(r"The (\w+) of (\w+) is (\w+)\.", text)
        facts = {(a, subj): v for a, subj, v in stated}
        asked = re.findall(r"Question: What is the (\w+) of (\w+)\?\nAnswer: (\w+)\.", text)
        assert asked and all(facts[(a, subj)] == v for a, subj, v in asked), (stated, asked)
        assert len(facts) == len(stated)  # no question is ambiguous
        assert (w == 4.0).sum() == sum(len(s.encode(f" {v}.")) for *_, v in asked)
        assert len(asked) == (queries or 1) and (3 <= len(stated) <= 16 if queries else 1 <= len(stated) <= 3)


def test_title_rows_ask_which_paragraph_has_a_title_their_text_gives(tok):
    """A title row read back by regex: 4-15 paragraphs opened by distinct titles and numbers 1..n in order,
    TITLE_QUERIES questions, each answered with the number that follows the asked title."""
    import re

    from kvjax.experiments.tasks import TITLE_QUERIES

    code = docs = np.arange(4, 400, dtype=np.int32).repeat(50)
    s = RowSampler(tok, code, docs, 2048, mixture=Mixture(text=0, passkey=0, kv=0, facts=0, copy=0, induction=0,
                                                          titles=1), answer_weight=4.0)
    sizes = set()
    for seed in range(6):
        ids, w = s.row(np.random.default_rng(seed), 1500)
        text = tok.decode(ids[ids != tok.bos_token_id])
        heads = re.findall(r"\n\n(\w+) \((\d+)\): ", text)
        asked = re.findall(r"Question: Which paragraph is titled (\w+)\?\nAnswer: (\d+)\.", text)
        assert [int(k) for _, k in heads] == list(range(1, len(heads) + 1)) and 4 <= len(heads) <= 15
        assert len(dict(heads)) == len(heads)  # no question is ambiguous
        assert len(asked) == TITLE_QUERIES and all(dict(heads)[t] == k for t, k in asked), (heads, asked)
        assert (w == 4.0).sum() == sum(len(s.encode(f" {k}.")) for _, k in asked)
        sizes.add(len(heads))
    assert len(sizes) > 1


def test_count_rows_ask_how_often_each_hidden_sound_occurs(tok):
    """A count row read back by str.count: 2-4 sounds hidden in text, each asked once and answered with how
    often its line occurs in the row (1-5)."""
    import re

    from kvjax.experiments.tasks import MARKERS

    code = docs = np.arange(4, 400, dtype=np.int32).repeat(50)
    s = RowSampler(tok, code, docs, 2048, mixture=Mixture(text=0, passkey=0, kv=0, facts=0, copy=0, induction=0,
                                                          counts=1), answer_weight=4.0)
    answers = []
    for seed in range(6):
        ids, w = s.row(np.random.default_rng(seed), 1500)
        text = tok.decode(ids[ids != tok.bos_token_id])
        asked = re.findall(r"Question: How many times does (.+)\?\nAnswer: (\d)\.", text)
        assert 2 <= len(asked) <= 4 and len({q for q, _ in asked}) == len(asked)
        for q, n in asked:
            line = next(t for t, question in MARKERS if question == q)
            assert text.count(line) == int(n) and 1 <= int(n) <= 5, (q, n)
        assert sum(text.count(t) for t, _ in MARKERS) == sum(int(n) for _, n in asked)  # nothing unasked
        assert (w == 4.0).sum() == sum(len(s.encode(f" {n}.")) for _, n in asked)
        answers += [n for _, n in asked]
    assert len(set(answers)) >= 4


def test_extend_mixture_option_names_every_bad_kind_and_share(capsys):
    from kvjax.experiments.train_small import mixture, parse

    assert mixture("kv=0.5,suite=0.5") == Mixture(text=0, passkey=0, kv=0.5, facts=0, copy=0, induction=0, suite=0.5)
    for bad, says in [("kv=x", "'kv=x'"), ("keys=1", "'keys=1'"), ("kv=0", "not all 0"), ("kv=-1,text=2", ">= 0")]:
        with pytest.raises(SystemExit):
            parse(["--from", "m", "--out", "x", "--extend-steps", "1", "--extend-mixture", bad])
        assert says in capsys.readouterr().err
    args = parse(["--from", "m", "--out", "x", "--extend-steps", "1", "--extend-mixture", "kv=1"])
    assert json.dumps(vars(args))  # the run's record stays JSON


def test_the_card_reads_its_training_record_from_the_run_else_from_the_last_card(tmp_path):
    """`small_card` beside a trained model reads training/run.json; in a clone (weights and card, no training
    folder, which git ignores) it reads the record the last card kept in eval.json; with neither it names
    both files and the command that writes them."""
    import json

    from kvjax.experiments import small_card
    from kvjax.experiments.small_card import training_record
    from kvjax.errors import InvalidInput, MissingFile

    with pytest.raises(MissingFile, match=r"neither .*run.json nor .*eval.json.*train_small --out"):
        training_record(tmp_path)
    (tmp_path / "eval.json").write_text(json.dumps({"eval": {}, "training": {"command": "card's"},
                                                    "loss_at_end": "1.3 (mean of the last 50 steps)"}))
    assert training_record(tmp_path) == ({"command": "card's"}, "1.3 (mean of the last 50 steps)")
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "run.json").write_text(json.dumps({"command": "run's"}))
    assert training_record(tmp_path) == ({"command": "run's"}, None)  # a retrained model: not the old card's loss
    # the card's held-out text is this Python's standard library: another one's would give other numbers
    (tmp_path / "training" / "run.json").write_text(json.dumps({"corpus": "python0.0.0-0123456789"}))
    with pytest.raises(InvalidInput, match=r"corpus python0.0.0-0123456789; this Python's standard library is python3"):
        small_card.main(["--model", str(tmp_path)])

