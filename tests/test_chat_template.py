"""--chat-template (issue 65, item 2): the prompt format of every suite that builds prompts. The context and question
ids equal kvpress's `KVPressTextGenerationPipeline.preprocess` for a tokenizer with a chat template and for one without;
the resolved mode is in each run's identity, records and tables; `on` is refused for a tokenizer without a template."""

from __future__ import annotations

import json
import shutil
import types

import pytest

from kvjax.experiments import cli
from kvjax.experiments.common import chat_parts, chat_template_on, prompt_ids

# SmolLM2-Instruct's template (ChatML with a default system turn), as its tokenizer_config.json ships it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tokenizer(template: bool):
    """kvjax/models/default's tokenizer (local, no network), with SmolLM2-Instruct's chat template or without one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained("kvjax/models/default")
    tok.chat_template = SMOLLM2_TEMPLATE if template else None
    return tok


def kvpress_ids(tok, context, question, answer_prefix):
    from kvpress.pipeline import KVPressTextGenerationPipeline

    out = KVPressTextGenerationPipeline.preprocess(types.SimpleNamespace(tokenizer=tok), context, [question],
                                                   answer_prefix, max_context_length=10**9)
    return out["context_ids"][0].tolist(), out["questions_ids"][0][0].tolist()


CASES = [("Some long context.\nThe pass key is 71432. Remember it.", "What is the pass key?", " The pass key is"),
         ("A haystack # with a hash, and ### more.", " What is the special magic number?", ""),
         ("", "Question only?", " Answer:")]


@pytest.mark.parametrize("template", [True, False], ids=["template", "no-template"])
@pytest.mark.parametrize("case", CASES)
def test_ids_equal_kvpress_pipeline_preprocess(template, case):
    tok = tokenizer(template)
    ours = prompt_ids(tok, *case, on=chat_template_on(tok, "auto"))
    assert ours == kvpress_ids(tok, *case)
    if template:  # the context sits inside the user turn; the end of the turn and the header follow the question
        head, suffix = chat_parts(tok, True)
        assert head.endswith("<|im_start|>user\n") and suffix == "<|im_end|>\n<|im_start|>assistant\n"
        assert tok.decode(ours[0]).startswith("<|im_start|>system") and "<|im_end|>" not in tok.decode(ours[0])[-12:]
    else:
        assert ours[0][0] == tok.bos_token_id and tok.decode(ours[1]).startswith(case[1] + "\n")


def test_auto_resolves_per_tokenizer_and_off_is_raw_even_with_a_template():
    assert chat_template_on(tokenizer(True), "auto") and not chat_template_on(tokenizer(False), "auto")
    tok = tokenizer(True)
    assert prompt_ids(tok, *CASES[0], on=False) == kvpress_ids(tokenizer(False), *CASES[0])
    assert chat_template_on(tok, "on") and not chat_template_on(tok, "off")


# ---- the suites: the resolved mode in the identity, the records' keys and the tables ----


# A short template for the suites' runs: kvjax/models/default's tokenizer spells ChatML's markers out letter by letter, and
# SmolLM2's system turn leaves RULER's smallest haystack no room in its 512 tokens.
SHORT_TEMPLATE = ("{% for m in messages %}U: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:"
                  "{% endif %}")


@pytest.fixture(scope="module")
def templated_dir(tmp_path_factory):
    """kvjax/models/default with a chat template in its tokenizer_config.json."""
    d = tmp_path_factory.mktemp("templated") / "default"
    shutil.copytree("kvjax/models/default", d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": SHORT_TEMPLATE}))
    return d


def ruler_argv(model, out, *extra):
    return ["--model", str(model), "--tasks", "niah_single_1", "--max-new-tokens", "4", "--samples", "1", "--batch",
            "1", "--compare", "full", "--out", str(out), *extra]


def test_ruler_mode_is_in_identity_records_and_table(templated_dir, tmp_path, capsys):
    from kvjax.experiments.ruler import __main__ as ruler_cli

    on, off = tmp_path / "on", tmp_path / "off"
    assert cli.run(ruler_cli.main, ruler_argv(templated_dir, on)) == 0  # auto: the tokenizer has a template
    assert cli.run(ruler_cli.main, ruler_argv(templated_dir, off, "--chat-template", "off")) == 0
    assert json.loads((on / "identity.json").read_text())["--chat-template"] == "on"
    assert json.loads((off / "identity.json").read_text())["--chat-template"] == "off"
    rec_on, rec_off = (json.loads((d / "preds.jsonl").read_text().splitlines()[0]) for d in (on, off))
    assert rec_on["id"] != rec_off["id"] and "template-on" in rec_on["id"]
    assert "chat template on" in (on / "results.md").read_text()
    assert "chat template off" in (off / "results.md").read_text()
    capsys.readouterr()
    # two runs differing only in --chat-template never share a directory of records
    assert cli.run(ruler_cli.main, ruler_argv(templated_dir, on, "--chat-template", "off")) == 2
    assert "--chat-template: 'on' -> 'off'" in capsys.readouterr().err
    assert cli.run(ruler_cli.main, ruler_argv(templated_dir, on, "--chat-template", "on")) == 0  # = auto here


def test_records_made_before_the_option_are_another_configuration(templated_dir, tmp_path, capsys):
    from kvjax.experiments.ruler import __main__ as ruler_cli

    out = tmp_path / "old"
    assert cli.run(ruler_cli.main, ruler_argv(templated_dir, out, "--chat-template", "off")) == 0
    identity = json.loads((out / "identity.json").read_text())
    del identity["--chat-template"]  # as every directory written before the option
    (out / "identity.json").write_text(json.dumps(identity))
    capsys.readouterr()
    assert cli.run(ruler_cli.main, ruler_argv(templated_dir, out)) == 2
    assert "--chat-template: (not recorded) -> 'on'" in capsys.readouterr().err


def test_on_is_refused_for_a_tokenizer_without_a_template(tmp_path, capsys):
    from kvjax.experiments.ruler import __main__ as ruler_cli

    assert cli.run(ruler_cli.main, ruler_argv("kvjax/models/default", tmp_path / "r", "--chat-template", "on")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --chat-template on: the model's tokenizer has no chat template") and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


def test_kvzip_replays_in_the_prompt_format_and_a_mismatch_is_refused(templated_dir):
    from kvjax.experiments import driver
    from kvjax.kvzip import replay_prompts
    from kvjax.models.loading import tokenizer_at

    tok = tokenizer_at(templated_dir)
    on = driver.resolve_policies("kvzip", ratio=0.5, model_dir=templated_dir, chat=True)["kvzip"]
    off = driver.resolve_policies("kvzip", ratio=0.5, model_dir=templated_dir)["kvzip"]
    want = replay_prompts(tok, chat=True)
    assert (list(on.suffix_ids), on.prefix) == (list(want["suffix_ids"]), want["prefix"]) and on.prefix > 0
    assert tok.decode(list(on.suffix_ids)) == "\nA:" and tok.decode(list(off.suffix_ids)) == "\n"
    driver.check_replay({"kvzip": on}, templated_dir, True)
    driver.check_replay({"kvzip": off}, templated_dir, False)
    with pytest.raises(driver.ArgumentError, match="not those of chat_template=on"):
        driver.check_replay({"kvzip": off}, templated_dir, True)
