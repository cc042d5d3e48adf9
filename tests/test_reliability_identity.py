"""Issue 89 items 3, 5 and 10, issue 90 item 4: a run's identity comes from what computed it (the model in memory,
kvjax's source), a resumed run says so, and two runs never share an --out (a suite's or a training run's)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
from flax import nnx

from kvjax import locks
from kvjax.errors import InvalidInput
from kvjax.experiments import passkey
from kvjax.experiments.identity import model_identity, source_digest
from kvjax.policies import FullCache, StreamingLLM

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))


def run_passkey(lm, out, policy=None, **kw):
    return passkey.suite(lm, [policy or StreamingLLM(budget=64, sinks=4)], out, lengths=[300], depths=[0.5],
                         samples=2, progress=False, **kw)


def scaled(lm, factor: float):
    """`lm` with every weight multiplied by `factor`: another model under the same path."""
    graphdef, state = nnx.split(lm.model)
    return dataclasses.replace(lm, model=nnx.merge(graphdef, jax.tree.map(lambda x: x * factor, state)))


def test_identity_two_models_in_memory_at_one_path_never_share_records(tiny, tmp_path):
    """A run's identity was the files under `lm.path`: a second model in memory (weights x 1.01) at the same path
    resumed silently into the first model's records. Its weights' digest now differs, and the run is refused
    naming it."""
    out = tmp_path / "pk"
    run_passkey(tiny, out)
    other = scaled(tiny, 1.01)
    assert model_identity(other.model)["weights"] != model_identity(tiny.model)["weights"]
    with pytest.raises(InvalidInput, match=r"holds results of another configuration \(weights: '[0-9a-f]{16}' -> "
                                           r"'[0-9a-f]{16}'\)"):
        run_passkey(other, out)
    assert model_identity(scaled(tiny, 1.0).model) == model_identity(tiny.model)  # the same arrays, the same model


def test_identity_a_model_without_a_path_runs_a_suite_and_resumes(tiny, tmp_path, capsys):
    """A model object with no path (`path=None`) ended in a raw `TypeError` from pathlib and left a lock behind. It
    runs, records its identity from itself, and a rerun resumes, saying how many records it reused."""
    lm = dataclasses.replace(tiny, path=None)
    out = tmp_path / "pk"
    first = run_passkey(lm, out)
    identity = json.loads((out / "identity.json").read_text())
    assert identity["model"] is None and identity["weights"] == model_identity(tiny.model)["weights"]
    assert identity["model class"] == "kvjax.models.llama.Llama" and identity["kvjax source"] == source_digest()
    passkey.suite(lm, [StreamingLLM(budget=64, sinks=4)], out, lengths=[300], depths=[0.5], samples=2)
    assert "passkey: resuming" in capsys.readouterr().err
    again = run_passkey(lm, out)
    assert again.summary == first.summary


def test_identity_an_edited_policy_starts_new_records_or_is_refused(tmp_path):
    """kvjax's identity was its version string, so a run after an edit to a policy reused the records of the code
    before it. A copy of kvjax with one policy's code edited has another source digest, and its run on the first
    run's --out is refused, naming it."""
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "kvjax", copy / "kvjax", ignore=shutil.ignore_patterns("__pycache__", "small", "kvzap",
                                                                                   "training"))
    ring = copy / "kvjax" / "policies" / "ring.py"
    ring.write_text(ring.read_text() + "\n# an edit\n")
    out = tmp_path / "pk"
    argv = ["-m", "kvjax.experiments.passkey", "--lengths", "300", "--depths", "0.5", "--samples", "1", "--policy",
            "streaming", "--budget", "64", "--out", str(out)]
    first = subprocess.run([sys.executable, *argv], cwd=REPO, env=ENV, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    edited = subprocess.run([sys.executable, *argv], cwd=copy, env=dict(ENV, PYTHONPATH=str(copy)),
                            capture_output=True, text=True)
    assert edited.returncode == 2, edited.stderr
    line = edited.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "kvjax source: '" in line and "pass a new --out" in line, line


HOLDER = textwrap.dedent("""
    import sys
    from kvjax import locks
    locks.hold(sys.argv[1])
    print("held", flush=True)
    sys.stdin.read()
""")


@pytest.fixture
def held(tmp_path):
    """A directory another process holds (as a run stopped while holding its --out: it keeps the lock)."""
    out = tmp_path / "held"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], env=ENV, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    yield out, holder.pid
    holder.stdin.close()
    holder.wait(timeout=60)
    assert not (out / locks.LOCK_NAME).exists()  # the holder let go, and its lock file went with it


def test_lock_a_suite_on_an_out_another_run_holds_is_refused(held, tiny):
    """A passkey run on an --out another process holds is refused in one line naming the holder, from Python and
    from the command line, and writes nothing there."""
    out, pid = held
    with pytest.raises(InvalidInput, match=rf"(--out|out=) {out} is in use by pid {pid} on "):
        run_passkey(tiny, out)
    cli = subprocess.run([sys.executable, "-m", "kvjax.experiments.passkey", "--lengths", "300", "--samples", "1",
                          "--out", str(out)], cwd=REPO, env=ENV, capture_output=True, text=True)
    assert cli.returncode == 2 and cli.stderr.strip().splitlines()[-1].startswith(f"error: --out {out} is in use by "
                                                                                  f"pid {pid}")
    assert sorted(p.name for p in out.iterdir()) == [locks.LOCK_NAME]


def test_lock_a_training_run_into_a_directory_another_run_holds_is_refused(held, tiny):
    """Two training runs into one directory both proceeded (their checkpoints would interleave): `kvjax.train.train`
    now holds its `out_dir`, so the second is refused naming the first."""
    from kvjax.train import TrainConfig, train

    out, pid = held
    with pytest.raises(InvalidInput, match=rf"is in use by pid {pid} on "):
        train(tiny.model, lambda i: {}, lambda m, b: (0.0, {}), TrainConfig(steps=1), out)


def test_lock_the_lock_file_goes_with_the_run(tmp_path):
    """A finished run leaves no lock file (a stale one misled readers into thinking a run held the directory)."""
    out = tmp_path / "pk"
    done = subprocess.run([sys.executable, "-m", "kvjax.experiments.passkey", "--lengths", "300", "--depths", "0.5",
                           "--samples", "1", "--out", str(out)], cwd=REPO, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (out / "identity.json").is_file() and not (out / locks.LOCK_NAME).exists()
    assert FullCache().describe() in (out / "results.md").read_text()
