"""The command-line main job."""

from __future__ import annotations

import re

import pytest

from kvjax.experiments import common
from kvjax.experiments import generate as gen_cli


def test_generate_cli_on_a_local_model(tiny_dir, capsys):
    assert gen_cli.main(["--model", str(tiny_dir), "--policy", "streaming", "--budget", "20",
                         "--max-new-tokens", "12", "hello there", "second prompt"]) == 0
    out = capsys.readouterr().out
    assert "RANDOM WEIGHTS" not in out  # an explicit --model is not labelled
    assert "StreamingLLM(budget=20, sinks=4, positions='absolute', prefill_mode='full')" in out
    assert out.count(">>> ") == 2
    # 2 layers x 2 KV heads x 20 slots; the full cache would hold the 16-token bucket + the 16-token
    # buffer of the 12 new tokens (max_new_tokens is bucketed, so 9..16 share one compilation)
    assert re.search(r"cache\s+20 slots per KV head and layer; 80 slots per sequence over layers x KV heads "
                     r"\(full cache: 128\)", out), out
    assert re.search(r"decode [\d.]+ tokens/s", out)


def test_generate_cli_default_model_is_labelled_random_when_the_trained_one_is_missing(tmp_path, monkeypatch,
                                                                                       capsys):
    from kvjax.experiments import default_model

    monkeypatch.setattr(default_model, "DEFAULT_MODEL_DIR", tmp_path / "no-such-model")
    monkeypatch.setattr(default_model, "RANDOM_DEFAULT_DIR", tmp_path / "random")
    assert gen_cli.main(["--max-new-tokens", "4", "--policy", "full"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("NOTE: RANDOM WEIGHTS")
    assert (tmp_path / "random" / "model.safetensors").is_file()


def test_generate_cli_rejects_bad_budget(tiny_dir):
    # The policy's message, with its parameter named as the command-line flag.
    with pytest.raises(ValueError, match=r"--policy streaming: StreamingLLM: --budget 3 is smaller than sinks \+ 1 = 5"):
        gen_cli.main(["--model", str(tiny_dir), "--budget", "3"])


def test_generate_cli_mat(tiny_dir, capsys):
    assert gen_cli.main(["--model", str(tiny_dir), "--policy", "mat", "--budget", "16", "--anchor-slots", "5",
                         "--shallow-layers", "1", "--sinks", "2", "--max-new-tokens", "30",
                         "a prompt longer than sixteen tokens"]) == 0
    out = capsys.readouterr().out
    assert "split=1, shallow=StreamingLLM(budget=16, sinks=2" in out and "AnchorCache(budget=16, anchor_slots=5" in out
    assert re.search(r"cache\s+16 slots per KV head and layer; 64 slots", out), out


def test_generate_cli_rejects_options_a_policy_does_not_take(tiny_dir):
    with pytest.raises(ValueError, match=r"--anchor-slots: no policy of streaming takes it"):
        gen_cli.main(["--model", str(tiny_dir), "--policy", "streaming", "--anchor-slots", "4"])


@pytest.mark.parametrize("argv", [
    ["--policy", "snapkv", "--budget", "40", "--observation-window", "8", "--kernel", "5", "--pool", "avg"],
    ["--policy", "pyramidkv", "--ratio", "0.5", "--observation-window", "8"],
    ["--policy", "slimkv", "--budget", "40", "--observation-window", "8", "--combine", "sum"],
    ["--policy", "h2o", "--budget", "40", "--recent", "10"],
    ["--policy", "tova", "--ratio", "0.5"],
    ["--policy", "knorm", "--budget", "40"],
    ["--policy", "h2o-prefill", "--budget", "40"],
])
def test_generate_cli_score_policies(tiny_dir, capsys, argv):
    prompt = "a prompt long enough that a forty token budget has something to remove " * 2
    assert gen_cli.main(["--model", str(tiny_dir), "--max-new-tokens", "6", *argv, prompt]) == 0
    out = capsys.readouterr().out
    caps = [int(c) for c in re.search(r"cache\s+([\d/]+) slots per KV head", out).group(1).split("/")]
    assert max(caps) < 256 + 16  # compressed: fewer slots than the 256-token bucket + the new tokens' buffer
