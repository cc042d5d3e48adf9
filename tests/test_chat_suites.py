"""--chat-template on the passkey and needle suites (issue #90, item 5): with the template, a prompt is what kvpress's
pipeline and transformers' template rendering make of it (the context in the user turn; the question, the end of the
turn, the assistant header and the answer's start after it), of the length asked; the mode is part of the run's
identity; `on` without a template is refused by name; raw text stays the default (the papers' protocol) and keeps
every earlier run's identity."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from kvjax.errors import InvalidInput
from kvjax.experiments import cli, needle, passkey
from kvjax.experiments.tasks import PASSKEY_ANSWER, PASSKEY_ASK, PASSKEY_INTRO, PASSKEY_QUESTION, passkey_needle
from kvjax.policies import StreamingLLM

from .test_chat_template import kvpress_ids, tokenizer


def rendered(tok, user: str) -> str:
    """transformers' rendering of one user turn and the assistant header (the template's own jinja)."""
    return tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_a_passkey_prompt_in_the_chat_template(depth):
    tok = tokenizer(True)
    ids, at = passkey.passkey_prompt(tok, 400, depth, 71432, chat=True)
    assert len(ids) == 400
    _, question = kvpress_ids(tok, "a context", PASSKEY_ASK, PASSKEY_ANSWER)  # kvpress's question ids
    assert ids[-len(question):] == question
    body = tok.decode(ids).split("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]  # the user turn's content
    assert body.startswith(PASSKEY_INTRO) and body.endswith(PASSKEY_ASK)
    assert tok.decode(ids) == rendered(tok, body) + PASSKEY_ANSWER
    assert tok.decode(ids[at:]).startswith(passkey_needle(71432))
    # raw text, the default, is as it was: BOS, the description, ..., the question with the answer's start
    raw, _ = passkey.passkey_prompt(tok, 400, depth, 71432)
    assert raw[0] == tok.bos_token_id and tok.decode(raw).endswith(PASSKEY_QUESTION) and len(raw) == 400


def test_a_needle_prompt_in_the_chat_template():
    tok = tokenizer(True)
    hay = tok("The sky is blue. The grass is green. " * 200, add_special_tokens=False)["input_ids"]
    ids, at = needle.needle_prompt(tok, hay, 300, 50, needle.NEEDLE, needle.QUESTION, chat=True)
    assert len(ids) == 300 and tok.decode(ids[at:]).startswith(needle.NEEDLE)
    _, question = kvpress_ids(tok, "a context", needle.QUESTION, "")
    assert ids[-len(question):] == question
    body = tok.decode(ids).split("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
    assert tok.decode(ids) == rendered(tok, body)


def test_the_chat_template_is_in_a_runs_identity(tiny, tmp_path):
    """The passkey suite with the template: its identity says so, and the raw run's --out refuses it (another
    configuration); a raw run's identity names no chat template (earlier runs resume as they were)."""
    tok = copy.deepcopy(tiny.tokenizer)  # the model's own (a byte tokenizer): every id inside its vocabulary
    tok.chat_template = ("{% for m in messages %}User: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}Assistant:{% endif %}")
    lm = dataclasses.replace(tiny, tokenizer=tok)

    def run(out, chat):
        return passkey.suite(lm, [StreamingLLM(budget=64, sinks=4)], out, lengths=[300], depths=[0.0], samples=1,
                             progress=False, chat=chat)

    run(tmp_path / "raw", False)
    run(tmp_path / "chat", True)
    assert "--chat-template" not in json.loads((tmp_path / "raw" / "identity.json").read_text())
    assert json.loads((tmp_path / "chat" / "identity.json").read_text())["--chat-template"] == "on"
    at = {m: json.loads((tmp_path / m / "samples.jsonl").read_text())["needle_at"] for m in ("raw", "chat")}
    assert at["chat"] == at["raw"] + len("User: ") - 1  # the prompt in the template: "User: " (bytes), not BOS
    with pytest.raises(InvalidInput, match="another configuration"):
        run(tmp_path / "raw", True)


@pytest.mark.parametrize("suite", [passkey, needle])
def test_on_without_a_template_is_refused_by_name(suite, tiny_dir, tmp_path, capsys):
    argv = ["--model", str(tiny_dir), "--lengths", "300", "--chat-template", "on", "--out", str(tmp_path / "o")]
    assert cli.run(suite.main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --chat-template on: the model's tokenizer has no chat template; pass --chat-template off "
                   "or auto"]
