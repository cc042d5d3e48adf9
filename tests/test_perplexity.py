"""The perplexity suite: StreamingLLM's token-by-token protocol against a single forward."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax.experiments import perplexity as ppl_cli
from kvjax.policies import FullCache, StreamingLLM
from kvjax.scoring import stream_logprobs
from kvjax.models.tiny import make_random_checkpoint, tiny_config
from kvjax import drive


def _full_forward_nll(model, ids):
    logits = np.asarray(drive.logits(model, np.asarray([ids])), np.float64)[0]
    m = logits.max(-1, keepdims=True)
    lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    ids = np.asarray(ids)
    return -lp[np.arange(len(ids) - 1), ids[1:]]


def test_full_cache_perplexity_equals_one_forward(sharp_dir):
    from kvjax.models import load

    model = load(sharp_dir).model
    ids = list(np.random.default_rng(0).integers(4, 260, 100))
    got = ppl_cli.measure(model, ids, FullCache())
    want = _full_forward_nll(model, ids)
    # float32 against a float64 softmax of the same logits; NLLs here are 2-14 nats
    np.testing.assert_allclose(-stream_logprobs(model, ids, FullCache()), want, rtol=1e-5)
    assert got["ppl"] == pytest.approx(float(np.exp(want.mean())), rel=1e-5)


def test_streaming_matches_full_cache_until_the_budget_fills(sharp_dir):
    from kvjax.models import load

    model = load(sharp_dir).model
    ids = list(np.random.default_rng(1).integers(4, 260, 80))
    budget = 24
    full = stream_logprobs(model, ids, FullCache())
    stream = stream_logprobs(model, ids, StreamingLLM(budget=budget, sinks=4))
    # token t + 1 is predicted from t + 1 tokens: identical while they all fit in the cache
    np.testing.assert_allclose(stream[:budget], full[:budget], atol=1e-5)
    assert np.abs(stream[budget + 4 :] - full[budget + 4 :]).max() > 1e-4  # and different once evicting


def test_cli_in_and_out_of_window(tmp_path):
    model_dir = make_random_checkpoint(tmp_path / "m", tiny_config(max_position_embeddings=64), seed=3)
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 10)
    out = tmp_path / "out"
    argv = ["--model", str(model_dir), "--text", str(text), "--lengths", "32,64,128", "--compare",
            "full,streaming", "--budget", "16", "--out", str(out)]
    assert ppl_cli.main(argv) == 0
    res = json.loads((out / "results.json").read_text())["ppl"]
    assert res["full"]["128"] is None and res["streaming"]["128"] is None  # absolute positions: not run
    assert res["full"]["64"] is not None and res["streaming"]["32"] is not None
    assert "n/a" in (out / "results.md").read_text() and (out / "perplexity.png").is_file()
    # rolling positions run beyond the window; the finished cells are reused (resume)
    lines_before = (out / "runs.jsonl").read_text().count("\n")
    assert ppl_cli.main(argv[:-6] + ["--compare", "streaming", "--budget", "16", "--positions", "rolling",
                                     "--out", str(out)]) == 0
    runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    rolled = [r for r in runs if "rolling" in r["policy"]]
    assert len(runs) == lines_before + 3 and all("ppl" in r for r in rolled)
    assert np.isfinite([r["ppl"] for r in rolled]).all()


def test_cli_errors(tmp_path, tiny_dir, capsys):
    from kvjax.policies import SnapKV
    from kvjax.models import load

    text = tmp_path / "t.txt"
    text.write_text("short")
    with pytest.raises(SystemExit):
        ppl_cli.main(["--model", str(tiny_dir), "--text", str(text), "--lengths", "100"])
    assert "the text has" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"does not evict|compresses a whole prompt once"):
        ppl_cli.measure(load(tiny_dir).model, [1, 2, 3, 4], SnapKV(budget=64))


def test_cli_averages_the_nll_of_several_sequences(tmp_path):
    """MAT Table 3's average over sequences: --sequences N scores N consecutive windows and the table's
    perplexity is exp(mean NLL); a rerun asking for more sequences resumes."""
    from kvjax.models import load

    model_dir = make_random_checkpoint(tmp_path / "m", tiny_config(max_position_embeddings=64), seed=3)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 97} of line {i}." for i in range(400)))
    out = tmp_path / "out"
    argv = ["--model", str(model_dir), "--text", str(text), "--lengths", "32", "--compare", "full", "--out", str(out)]
    assert ppl_cli.main(argv + ["--sequences", "2"]) == 0
    assert ppl_cli.main(argv + ["--sequences", "3"]) == 0  # more sequences: resumes
    lm = load(model_dir)
    ids = lm.tokenizer(text.read_text())["input_ids"]
    # each window's NLL from one plain causal forward (float64 log-softmax), not the CLI's token-by-token path
    nll = [_full_forward_nll(lm.model, ids[i * 32 : (i + 1) * 32]).mean() for i in range(3)]
    res = json.loads((out / "results.json").read_text())["ppl"]
    assert res["full"]["32"] == pytest.approx(np.exp(np.mean(nll)), rel=1e-5)
    assert (out / "runs.jsonl").read_text().count("\n") == 3  # one record per sequence, none recomputed


def test_cli_chunked_equals_stream_and_scores_snapkv(tmp_path, capsys):
    """`--prefill-mode chunked --chunk N`: StreamingLLM's perplexity is the token-by-token one, the
    records are a new identity (the description names the chunk), and a prompt compressor (SnapKV),
    which stream mode refuses, is scored chunk by chunk. --recompress-every with no prompt compressor
    is a one-line error naming the flag."""
    from tests.test_reliability import one_error_line, run_cli

    model_dir = make_random_checkpoint(tmp_path / "m", tiny_config(max_position_embeddings=256), seed=3)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 97} of line {i}." for i in range(200)))
    out = tmp_path / "out"
    base = ["--model", str(model_dir), "--text", str(text), "--lengths", "150", "--budget", "24", "--out", str(out)]
    assert ppl_cli.main(base + ["--compare", "streaming"]) == 0
    assert ppl_cli.main(base + ["--compare", "streaming,snapkv", "--observation-window", "8", "--prefill-mode", "chunked",
                                "--chunk", "16"]) == 0
    runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    stream = next(r for r in runs if r["policy"].startswith("StreamingLLM") and "chunk=" not in r["policy"])
    chunked = next(r for r in runs if r["policy"].startswith("StreamingLLM") and "chunk=16" in r["policy"])
    np.testing.assert_allclose(chunked["nll_per_token"], stream["nll_per_token"], atol=1e-4)
    assert any(r["policy"].startswith("SnapKV") and np.isfinite(r["ppl"]) for r in runs)
    capsys.readouterr()  # the progress bars so far
    code, err = run_cli(ppl_cli.main, base + ["--compare", "streaming", "--recompress-every", "8"], capsys)
    assert code == 2 and "--recompress-every 8: no policy of streaming" in one_error_line(err)


def test_anchor_grid_picks_mats_beta_on_a_tuning_window_it_never_scores(tmp_path, capsys):
    """MAT's β grid-searched per budget (issue 65, item 5): each β of the grid runs on the scored windows and on
    the window after them; MAT's row is the scored windows at the β with the lowest NLL on that tuning window."""
    from kvjax.policies import mat
    from kvjax.models import load

    model_dir = make_random_checkpoint(tmp_path / "m", tiny_config(max_position_embeddings=64), seed=3)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 97} of line {i}." for i in range(400)))
    out = tmp_path / "out"
    argv = ["--model", str(model_dir), "--text", str(text), "--lengths", "48", "--sequences", "2", "--budget", "16",
            "--compare", "streaming,mat", "--out", str(out)]
    assert ppl_cli.main(argv + ["--anchor-grid", "1,4,8"]) == 0
    lm = load(model_dir)
    ids = lm.tokenizer(text.read_text())["input_ids"]
    nll = lambda b, w: ppl_cli.measure(lm.model, ids[w * 48:(w + 1) * 48], mat(16, b, shallow_layers=1))["nll"]  # noqa: E731
    tuning = {b: nll(b, 2) for b in (1, 4, 8)}  # window 2: after the two scored ones
    best = min(tuning, key=tuning.get)
    res = json.loads((out / "results.json").read_text())
    grid = res["anchor_grid"]["mat"]["48"]
    assert grid["chosen"] == best and grid["tuning_nll"] == pytest.approx({str(b): v for b, v in tuning.items()})
    assert res["ppl"]["mat"]["48"] == pytest.approx(np.exp((nll(best, 0) + nll(best, 1)) / 2), rel=1e-5)
    assert f"anchor_slots={best}" in res["policies"]["mat"]
    assert f"mat at 48: β = {best}" in (out / "results.md").read_text()
    # the grid is part of the run's identity; without MAT, or for MAT at a ratio with "auto", it is refused
    from kvjax.errors import InvalidInput

    with pytest.raises(InvalidInput, match=r"--anchor-grid: \[1, 4, 8\] -> \[1, 4\]"):
        ppl_cli.main(argv + ["--anchor-grid", "1,4"])
    with pytest.raises(SystemExit):
        ppl_cli.main(argv[:-4] + ["--compare", "streaming", "--anchor-grid", "auto", "--out", str(tmp_path / "o2")])
    assert "no MAT policy" in capsys.readouterr().err


def test_leave_one_out_scores_each_window_at_the_beta_the_other_windows_chose(tmp_path, capsys):
    """`--anchor-tuning leave-one-out` (issue 65, item 5, when the text holds no window beyond the scored ones):
    window i is scored at the β of the grid with the lowest mean NLL on the other windows, computed here by hand
    from each window read alone (`--batch` 3 reads them as the rows of one batch)."""
    from kvjax.policies import mat
    from kvjax.models import load

    model_dir = make_random_checkpoint(tmp_path / "m", tiny_config(max_position_embeddings=64), seed=3)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{(7 * i) % 89} of line {i % 13}." for i in range(400)))
    out = tmp_path / "out"
    argv = ["--model", str(model_dir), "--text", str(text), "--lengths", "40", "--sequences", "3", "--budget", "12",
            "--compare", "streaming,mat", "--anchor-grid", "1,3,6", "--batch", "3", "--out", str(out)]
    assert ppl_cli.main(argv + ["--anchor-tuning", "leave-one-out"]) == 0
    lm = load(model_dir)
    ids = lm.tokenizer(text.read_text())["input_ids"]
    nll = {b: [ppl_cli.measure(lm.model, ids[w * 40:(w + 1) * 40], mat(12, b, shallow_layers=1))["nll"]
               for w in range(3)] for b in (1, 3, 6)}
    chosen = ppl_cli.leave_one_out(nll)
    res = json.loads((out / "results.json").read_text())
    assert res["anchor_grid"]["mat"]["40"]["chosen"] == chosen
    want = [nll[b][i] for i, b in enumerate(chosen)]
    assert res["ppl"]["mat"]["40"] == pytest.approx(np.exp(np.mean(want)), rel=1e-5)
    assert res["nll_per_sequence"]["mat"]["40"] == pytest.approx(want, rel=1e-5)
    assert f"anchor_slots={chosen} (leave-one-out)" in res["policies"]["mat"]
    assert "leave-one-out" in (out / "results.md").read_text()
    # StreamingLLM's windows, read three to a batch, are each window read alone
    stream = [ppl_cli.measure(lm.model, ids[w * 40:(w + 1) * 40], StreamingLLM(budget=12))["nll"] for w in range(3)]
    assert res["nll_per_sequence"]["streaming"]["40"] == pytest.approx(stream, rel=1e-5)
    # the tuning is part of the run's identity; leave-one-out needs two windows and a grid
    from kvjax.errors import InvalidInput

    with pytest.raises(InvalidInput, match=r"--anchor-tuning: .leave-one-out. -> \(not recorded\)"):
        ppl_cli.main(argv)
    for bad in (["--sequences", "1"], ["--anchor-grid"]):
        a = list(argv)
        i = a.index(bad[0])
        if len(bad) == 2:
            a[i + 1] = bad[1]
        else:
            del a[i:i + 2]
        with pytest.raises(SystemExit):
            ppl_cli.main(a + ["--anchor-tuning", "leave-one-out", "--out", str(tmp_path / "o2")])
    err = capsys.readouterr().err
    assert "--sequences 1, it needs at least 2" in err and "no anchor_grid to tune" in err


def test_leave_one_out_on_a_hand_computed_case():
    """Window 0's β is the one the other windows prefer: β 1 scores windows 0 and 2 best but window 1 worst, so
    windows 0 and 2 (whose others include window 1) take β 3, and window 1 (whose others are 0 and 2) takes β 1,
    neither each window's own best ([1, 3, 1]) nor the overall best (β 3 for all)."""
    assert ppl_cli.leave_one_out({1: [1.0, 5.0, 1.0], 3: [2.0, 0.0, 2.0]}) == [3, 1, 3]
    assert ppl_cli.leave_one_out({8: [1.0, 1.0], 2: [1.0, 1.0]}) == [8, 8]  # a tie: the first β given
