"""kvjax as a user installs it, outside the clone: the wheel holds everything a user runs (kvjax-small, the shipped
KVzap surrogates, the suites' data), installs as one importable name (`kvjax`, beside a researcher's own `models/`
and `experiments/` packages and a clone folder named `kvjax`), runs the main job, and runs the Colab notebooks.

The wheel is built from a copy of the tracked files (`git ls-files`), as `pip install git+...` builds it, and
installed into a venv that sees this environment's packages (its dependencies, no download) but imports kvjax
from the wheel. The quickstart notebook runs from it in the default suite; the other
three, and a venv built from the package index with the wheel's own dependencies, under `pytest -m slow`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "colab").glob("*.ipynb"))
RUN_BY_DEFAULT = {"quickstart"}  # the other three take 40-110 s each on 2 cores


def tracked() -> list[str]:
    got = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip("not a git checkout: the wheel is built from the tracked files")
    return got.stdout.splitlines()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The tracked files alone, as a clone has them (no build/, no caches, no untracked results)."""
    src = tmp_path_factory.mktemp("src") / "kvjax"
    for name in tracked():
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    return src


def build(source: Path, what: str, out: Path) -> Path:
    """`pip wheel` (or setuptools' sdist) of `source` into `out`, without a build environment from the index when
    this one has setuptools (the test extra pins it)."""
    if what == "wheel":
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(source), "-w",
               str(out)]
    else:
        cmd = [sys.executable, "-c", f"from setuptools import build_meta as b; b.build_sdist({str(out)!r})"]
    done = subprocess.run(cmd, cwd=source, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return next(out.glob("*.whl" if what == "wheel" else "*.tar.gz"))


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    return build(source, "wheel", tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The python of a venv with the wheel installed (its dependencies: this environment's, its site-packages
    appended to the venv's path by a `.pth` line, whose own `.pth` files, this checkout's editable install among
    them, are not run)."""
    import site

    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    own = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                         text=True, check=True).stdout.strip()
    Path(own, "zz_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    done = subprocess.run([python, "-m", "pip", "install", "--no-deps", "-q", str(wheel)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return python


def env(**extra) -> dict:
    out = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the clone on the path
    return {**out, "JAX_PLATFORMS": "cpu", "MPLBACKEND": "Agg", **extra}


def users_repo(where: Path) -> Path:
    """A research repository of a user's own: its `models/` and `experiments/` packages, and a clone of kvjax in a
    folder named `kvjax` (no `__init__.py` at its top)."""
    (where / "models").mkdir(parents=True)
    (where / "models" / "__init__.py").write_text('DEFAULT_DIR = "mine"\n')
    (where / "experiments").mkdir()
    (where / "experiments" / "__init__.py").write_text('WHOSE = "mine"\n')
    (where / "kvjax" / "docs").mkdir(parents=True)
    return where


def test_the_wheel_and_sdist_hold_every_file_kvjax_ships(source, wheel, tmp_path):
    """Every tracked file of the package (code, kvjax-small, the default model, the KVzap surrogates, the offline
    suites' data) is in the wheel and the sdist, and nothing installs a top-level `models` or `experiments`."""
    ships = {n for n in tracked() if n.startswith("kvjax/")}
    names = set(zipfile.ZipFile(wheel).namelist())
    assert sorted(ships - names) == []
    assert {"kvjax/models/small/model.safetensors", "kvjax/models/kvzap/smollm2/mlp/kvzap.json",
            "kvjax/experiments/longbench/data_small/stdlib_passkey.jsonl"} <= names
    assert not [n for n in names if n.split("/")[0] in ("models", "experiments", "tests", "benchmarks")]
    sdist = build(source, "sdist", tmp_path)
    with tarfile.open(sdist) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert sorted(ships - in_sdist) == []


def test_the_installed_wheel_runs_the_main_job_beside_a_users_own_packages(installed, tmp_path):
    """From a research repository with its own `models/` and `experiments/` packages and a clone folder named
    `kvjax`, the installed kvjax runs the main job (one dataset, one sample: its first step), and the user's own
    packages stay theirs."""
    repo = users_repo(tmp_path / "research")
    out = tmp_path / "lb"
    job = subprocess.run([installed, "-m", "kvjax.experiments.longbench", "--datasets", "stdlib_passkey",
                          "--samples", "1", "--compare", "full,streaming", "--out", str(out)],
                         cwd=repo, env=env(), capture_output=True, text=True)
    assert job.returncode == 0, job.stderr
    assert (out / "results.md").is_file() and "kvjax-small" in job.stdout
    mine = subprocess.run([installed, "-c", "import models, experiments, kvjax; from kvjax import StreamingLLM; "
                           "print(models.DEFAULT_DIR, experiments.WHOSE, kvjax.__file__)"],
                          cwd=repo, env=env(), capture_output=True, text=True)
    assert mine.returncode == 0, mine.stderr
    theirs, whose, where = mine.stdout.split()
    assert (theirs, whose) == ("mine", "mine") and str(installed.parents[1]) in where


NOTEBOOK = textwrap.dedent("""
    import sys
    import nbclient, nbformat
    nb = nbformat.read(sys.argv[1], as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": sys.argv[2]}}
                            ).execute()  # raises CellExecutionError, naming the cell, on any error
    print("cells", sum(c.cell_type == "code" for c in nb.cells))
""")


@pytest.mark.parametrize("path", [p if p.stem in RUN_BY_DEFAULT else pytest.param(p, marks=pytest.mark.slow)
                                  for p in NOTEBOOKS], ids=lambda p: p.stem)
def test_the_notebooks_run_top_to_bottom_from_the_installed_wheel(installed, path, tmp_path):
    """Each Colab notebook, every cell, in a kernel of the venv that has the wheel installed (the install cell is
    skipped there, as on a runtime where kvjax is installed); the last on its offline fallback, kvjax-small."""
    pytest.importorskip("nbclient")
    where = users_repo(tmp_path / "research")
    done = subprocess.run([installed, "-c", NOTEBOOK, str(path), str(where)], cwd=where,
                          env=env(KVJAX_MODEL_DIR=str(tmp_path / "no-model")), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_a_fresh_venv_from_the_package_index_installs_the_wheel_and_runs_the_main_job(wheel, tmp_path):
    """The route a new user takes: a venv with nothing in it, the notebooks' install cell with `KVJAX_SOURCE` the
    wheel (its dependencies from the package index), the main job on kvjax-small from a directory outside the
    clone. Its first screen carries no advice a user cannot act on (transformers' "PyTorch was not found", a
    warning's source line)."""
    import nbformat

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    cell = next(c.source for c in nbformat.read(REPO / "colab" / "quickstart.ipynb", as_version=4).cells
                if c.cell_type == "code")
    assert 'KVJAX_SOURCE = ""' in cell
    t0 = time.perf_counter()
    done = subprocess.run([python, "-c", cell.replace('KVJAX_SOURCE = ""', f"KVJAX_SOURCE = {str(wheel)!r}")],
                          cwd=tmp_path, env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    installed_s = time.perf_counter() - t0
    repo = users_repo(tmp_path / "research")
    job = subprocess.run([python, "-m", "kvjax.experiments.longbench", "--datasets", "stdlib_passkey", "--samples",
                          "1", "--out", str(tmp_path / "lb")], cwd=repo, env=env(), capture_output=True, text=True)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "PyTorch was not found" not in job.stderr and "UserWarning" not in job.stderr, job.stderr
    print(f"installed in {installed_s:.0f} s")
