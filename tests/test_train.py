"""kvjax.train: exact resume after a crash, trainable subsets, accumulation, the anchor-masked loss."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.anllm_anchors import anchor_flags, anchor_mask
from kvjax.train import TrainConfig, next_token_loss, schedule, train
from kvjax.models import load
from kvjax import drive


class Crash(RuntimeError):
    pass


def _batches(crash_at=None):
    def batch(i):
        if crash_at is not None and i == crash_at:
            raise Crash(f"killed at micro-batch {i}")
        rng = np.random.default_rng(i)  # the data position is the micro-batch index
        toks = rng.integers(4, 260, size=(2, 24)).astype(np.int32)
        toks[:, 7::8] = 10  # anchors
        return {"tokens": jnp.asarray(toks)}

    return batch


def anchor_loss(model, batch):
    toks = batch["tokens"]
    logits = drive.logits(model, toks, anchors=anchor_mask(anchor_flags(toks, (10,))))
    return next_token_loss(logits, toks), {}


def _params(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_killed_and_resumed_run_equals_uninterrupted(tiny_dir, tmp_path):
    cfg = TrainConfig(steps=6, lr=1e-3, warmup=2, accum=2, save_every=1)
    straight = train(load(tiny_dir).model, _batches(), anchor_loss, cfg, tmp_path / "a", progress=False)

    model = load(tiny_dir).model
    with pytest.raises(Crash):
        train(model, _batches(crash_at=7), anchor_loss, cfg, tmp_path / "b", progress=False)  # dies in step 4
    resumed = train(load(tiny_dir).model, _batches(), anchor_loss, cfg, tmp_path / "b", progress=False)
    assert resumed.resumed_from == 3
    for a, b in zip(_params(straight.model), _params(resumed.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history]
    assert straight.history[-1]["loss"] < straight.history[0]["loss"]
    assert len(json.loads((tmp_path / "b" / "loss.json").read_text())) == 6
    assert (tmp_path / "b" / "loss.png").stat().st_size > 1000


def test_training_identity_refuses_to_resume_another_run(tiny_dir, tmp_path):
    """A checkpoint is resumed only by a run of the same identity (its TrainConfig and the caller's
    options): the same command with another learning rate once resumed the old run's weights silently."""
    from kvjax.errors import InvalidInput

    cfg = TrainConfig(steps=2, lr=1e-3, warmup=0, save_every=1)
    train(load(tiny_dir).model, _batches(), anchor_loss, cfg, tmp_path / "r", progress=False,
          identity={"--data": "a.txt"})
    with pytest.raises(InvalidInput, match=r"TrainConfig.lr: 0.001 -> 0.002"):
        train(load(tiny_dir).model, _batches(), anchor_loss, TrainConfig(steps=3, lr=2e-3, warmup=0, save_every=1),
              tmp_path / "r", progress=False, identity={"--data": "a.txt"})
    with pytest.raises(InvalidInput, match=r"--data: 'a.txt' -> 'b.txt'"):
        train(load(tiny_dir).model, _batches(), anchor_loss, cfg, tmp_path / "r", progress=False,
              identity={"--data": "b.txt"})
    same = train(load(tiny_dir).model, _batches(), anchor_loss, cfg, tmp_path / "r", progress=False,
                 identity={"--data": "a.txt"})
    assert same.resumed_from == 2


def test_cli_identity_train_anllm_rerun_with_another_lr_is_refused(tiny_dir, tmp_path, capsys):
    """The command-line form: `train_anllm --out X` again with another --lr ends in one line naming it."""
    from kvjax.experiments import cli, train_anllm

    data = tmp_path / "d.txt"
    data.write_text("The cache holds keys. Anchors compress a sentence. " * 40)
    argv = ["--model", str(tiny_dir), "--variant", "ep", "--out", str(tmp_path / "x"), "--data", str(data),
            "--steps", "1", "--seq-len", "32", "--batch", "2", "--warmup", "0", "--lr", "1e-3"]
    assert train_anllm.main(argv) == 0
    capsys.readouterr()
    code = cli.run(train_anllm.main, [a if a != "1e-3" else "2e-3" for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "TrainConfig.lr: 0.001 -> 0.002" in err[0] and "--lr: 0.001 -> 0.002" in err[0]


def test_trainable_subset_and_bf16(tiny_dir, tmp_path):
    before = load(tiny_dir).model
    cfg = TrainConfig(steps=2, lr=1e-2, warmup=0, trainable=(r"q_proj",), compute_dtype="bfloat16")
    model = train(load(tiny_dir).model, _batches(), anchor_loss, cfg, tmp_path, progress=False).model
    flat_b, flat_a = nnx.to_flat_state(nnx.state(before, nnx.Param)), nnx.to_flat_state(nnx.state(model, nnx.Param))
    for (path, va), (_, vb) in zip(flat_a, flat_b):
        same = np.array_equal(np.asarray(va[...]), np.asarray(vb[...]))
        assert same != ("q_proj" in "/".join(map(str, path))), path
    with pytest.raises(ValueError, match="no parameter matches"):
        train(load(tiny_dir).model, _batches(), anchor_loss, TrainConfig(steps=1, trainable=("nope",)), tmp_path / "x")


def test_schedule_and_config_errors():
    s = schedule(TrainConfig(steps=10, lr=2e-5, warmup=20))
    assert float(s(0)) == 0.0 and abs(float(s(10)) - 1e-5) < 1e-12 and abs(float(s(50)) - 2e-5) < 1e-12
    with pytest.raises(ValueError, match="lr=0"):
        TrainConfig(steps=1, lr=0)
    with pytest.raises(ValueError, match="compute_dtype='fp8'"):
        TrainConfig(steps=1, compute_dtype="fp8")
    with pytest.raises(ValueError, match="decay='linear'"):
        TrainConfig(steps=1, decay="linear")


def test_cosine_schedule_decays_to_min_ratio_at_the_last_step():
    s = schedule(TrainConfig(steps=110, lr=1e-3, warmup=10, decay="cosine", min_lr_ratio=0.1))
    assert abs(float(s(10)) - 1e-3) < 1e-9                 # peak at the end of the warmup
    assert abs(float(s(60)) - 1e-3 * (0.1 + 0.9 * 0.5)) < 1e-9  # half way through the cosine
    assert abs(float(s(110)) - 1e-4) < 1e-9                # min_lr_ratio * lr at the last step
