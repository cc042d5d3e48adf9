"""Every suite whose rows are independent runs them in batches by default (RULER 4, LongBench 8, passkey 8, needle 5)
and predicts, row by row, what it predicts one row at a time: left padding, the batch's shared prompt bucket and the
policies' per-row budgets change no record. Each suite's command line at `--batch 1` and at a batch of 3, on the
same cells, gives the same records (every field but the run's own batch size). RULER, passkey and needle batch
prompts of one length; LongBench's rows differ in length, so its batches are left padded (seen failing with padding
positions made visible)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvjax.experiments import cli
from kvjax.experiments import needle
from kvjax.experiments import passkey
from kvjax.experiments.longbench import __main__ as lb_cli
from kvjax.experiments.ruler import __main__ as ruler_cli


def _records(out: Path) -> dict:
    """Every record the run wrote (its .jsonl logs), by file and id; the identity and the timing fields aside."""
    got = {}
    for path in sorted(out.rglob("*.jsonl")):
        if path.parent.name == "data":  # the generated prompts, not predictions
            continue
        for line in path.read_text().splitlines():
            r = json.loads(line)
            r = {k: v for k, v in r.items() if not k.endswith("_s") and k not in ("seconds", "time")}
            got[(str(path.relative_to(out)), r.get("id", r.get("_id")), r.get("policy"))] = r
    assert got, f"no records under {out}"
    return got


def _same_at_batches(main, argv, tmp_path, batches=(1, 3)):
    runs = []
    for b in batches:
        out = tmp_path / f"batch{b}"
        assert cli.run(main, [*argv, "--batch", str(b), "--out", str(out)]) == 0
        runs.append(_records(out))
    assert runs[0].keys() == runs[1].keys()
    for key in runs[0]:
        assert runs[0][key] == runs[1][key], key
    return runs[0]


@pytest.mark.slow  # over 20 s on 2 cores (issue 88: the default suite within 15 minutes)
def test_ruler_batched_equals_one_by_one(tmp_path):
    recs = _same_at_batches(ruler_cli.main, ["--tasks", "niah_single_1,niah_multikey_2", "--samples", "3",
                                             "--max-new-tokens", "8", "--compare", "full,snapkv,streaming,kvzip",
                                             "--ratios", "0.5", "--observation-window", "8"], tmp_path)
    assert len(recs) == 2 * 3 * 4  # tasks x samples x (full + three policies at 0.5)


def test_passkey_batched_equals_one_by_one(tmp_path, tiny_dir):
    recs = _same_at_batches(passkey.main, ["--model", str(tiny_dir), "--lengths", "280,360", "--depths", "0,0.5,1",
                                           "--samples", "1", "--compare", "full,snapkv,h2o", "--budget", "48",
                                           "--observation-window", "8"], tmp_path)
    assert len(recs) == 2 * 3 * 3


@pytest.mark.slow  # over 20 s on 2 cores (issue 88: the default suite within 15 minutes)
def test_longbench_batched_equals_one_by_one(tmp_path, tiny_dir):
    from tests.test_longbench import _suite_dir

    data = _suite_dir(tmp_path, n=4)
    _same_at_batches(lb_cli.main, ["--model", str(tiny_dir), "--data-dir", str(data), "--compare",
                                   "full,streaming,snapkv", "--budget", "64", "--observation-window", "8"], tmp_path)


def test_needle_batched_equals_one_by_one(tmp_path, tiny_dir):
    hay = tmp_path / "hay"
    hay.mkdir()
    (hay / "a.txt").write_text(" ".join(f"Line {i} of the haystack." for i in range(300)))
    recs = _same_at_batches(needle.main, ["--model", str(tiny_dir), "--haystack", str(hay), "--lengths", "200,300",
                                          "--depths", "0,50,100", "--compare", "full,streaming", "--budget", "64"],
                            tmp_path)
    assert len(recs) == 12


@pytest.mark.parametrize("main", [ruler_cli.main, passkey.main, lb_cli.main, needle.main])
def test_suites_batch_by_default(main):
    """Batched by default: each suite's parser gives --batch > 1."""
    import argparse

    seen = {}
    real = argparse.ArgumentParser.parse_args

    def spy(self, args=None, namespace=None):
        ns = real(self, args, namespace)
        seen["batch"] = ns.batch
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = spy
    try:
        with pytest.raises(SystemExit):
            main([])
    finally:
        argparse.ArgumentParser.parse_args = real
    assert seen["batch"] > 1
