"""Crash-safe result records: an interrupted evaluation resumes without losing finished work, and
never over the records of another configuration.

* `ResultLog`: JSON lines, one record each, appended and fsynced as each finishes.
* `claim_results_dir`: OUT/identity.json, the whole configuration that produced OUT's records.
* `write_atomic`: every rewrite goes to a temporary file that replaces the old one only once
  complete (fsync, then rename), so a kill or a full disk never leaves a half-written file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from kvjax import locks
from kvjax.errors import InvalidInput, MissingFile, NonFiniteError
from kvjax.locks import LOCK_NAME


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()


def write_atomic(path: str | Path, text: str) -> None:
    """Replaces `path` with `text` all at once: readers (and a rerun after a kill) see the old
    file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _FILE_MODE)  # mkstemp creates 0600; results are shared as any file written with open()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout's root (kvjax/experiments/records.py)


def shown(path) -> str:
    """A path as tables and reports print it: an embedded or fetched model by its name (`kvjax-small`,
    `smollm2`), else relative to the repository when inside it, anything else as given; never the home directory
    of the machine that ran it, nor where the wheel was installed."""
    from kvjax.models import fetch
    from kvjax.models.embedded import EMBEDDED

    p = Path(str(path)).expanduser()
    for name, where in EMBEDDED.items():
        if p.resolve() == where.resolve():
            return name
    try:
        return str(p.resolve().relative_to(REPO_ROOT))
    except ValueError:
        pass

    for name in fetch.KNOWN:
        try:
            if p.resolve() == fetch.cached_path(name).resolve():
                return name
        except OSError:
            pass
    return str(path)


def write_csv_atomic(path: str | Path, rows: Iterable[Iterable]) -> None:
    """`rows` as a CSV file, written all at once (`write_atomic`)."""
    import csv
    import io

    buf = io.StringIO(newline="")
    csv.writer(buf).writerows(rows)
    write_atomic(path, buf.getvalue())


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # not every platform opens directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def dumps_finite(record: dict) -> str:
    """One record as a JSON line; a NaN or an infinity anywhere in it is an error naming the field."""
    try:
        return json.dumps(record, allow_nan=False)
    except ValueError:
        bad = [k for k, v in record.items() if _has_nonfinite(v)]
        raise NonFiniteError(f"record {record.get('id', record.get('_id', ''))!r} has a non-finite value in "
                             f"{bad}: it is not stored, so no table shows it as a number") from None


def _has_nonfinite(v) -> bool:
    if isinstance(v, float):
        return not math.isfinite(v)
    if isinstance(v, dict):
        return any(_has_nonfinite(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_nonfinite(x) for x in v)
    return False


def _no_constants(name: str):
    raise ValueError(name)


def read_json(path: str | Path, what: str = "records") -> object:
    """A JSON file of records or results, strictly: a missing one is a `MissingFile`, a torn or edited one an
    `InvalidInput`, and a NaN or an infinity in it a `NonFiniteError`, each one line naming the file (Python's
    json reads NaN silently, and a table then showed it as a number)."""
    path = Path(path)
    if not path.is_file():
        raise MissingFile(f"{path}: no {what} there")
    try:
        return json.loads(path.read_text(encoding="utf-8"), parse_constant=_no_constants)
    except json.JSONDecodeError as err:
        raise InvalidInput(f"{path} is not valid JSON ({err.msg} at line {err.lineno}); it was torn or edited") \
            from None
    except ValueError as err:
        raise NonFiniteError(f"{path} holds a non-finite number ({err}): no table is made from it") from None


def read_records(path: str | Path, what: str = "records", key: str = "id") -> list[dict]:
    """The JSON lines of a records file, strictly (`read_json`'s refusals, per line) and each `key` once: a record
    written twice (a copy appended by hand, two runs' logs concatenated) is an `InvalidInput` naming it."""
    path = Path(path)
    if not path.is_file():
        raise MissingFile(f"{path}: no {what} records there")
    rows, seen = [], {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, parse_constant=_no_constants)
        except json.JSONDecodeError:
            raise InvalidInput(f"{path}:{n} is not valid JSON; the record was torn or edited") from None
        except ValueError as err:
            raise NonFiniteError(f"{path}:{n} holds a non-finite number ({err}): no table is made from it") from None
        if not isinstance(row, dict):
            raise InvalidInput(f"{path}:{n} is not a record (a JSON object)")
        if key in row:
            if str(row[key]) in seen:
                raise InvalidInput(f"{path}:{n} repeats the record {row[key]!r} of line {seen[str(row[key])]}: each "
                                   "record once")
            seen[str(row[key])] = n
        rows.append(row)
    return rows


class ResultLog:
    """Records keyed by `key` (a field every record has), one JSON object per line.

    Each record is appended, flushed and fsynced as soon as it is added, so a crash loses at most
    the record being written. A torn last line (the crash happened mid-write) is dropped on load,
    by an atomic rewrite: the finished records are never at risk. A record holding NaN or
    inf is refused, when added and when read back.
    """

    def __init__(self, path: str | Path, key: str = "id"):
        self.path, self.key = Path(path), key
        self.records: dict[str, dict] = {}
        if not self.path.is_file():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines()
        torn = False
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line, parse_constant=_no_constants)
            except json.JSONDecodeError:
                if n == len(lines) - 1:
                    torn = True  # torn by a crash: drop it, it will be recomputed
                    break
                raise InvalidInput(f"{self.path}:{n + 1} is not valid JSON; delete the line (or the file) "
                                   "to recompute it") from None
            except ValueError as err:  # NaN / Infinity written by an older kvjax
                raise NonFiniteError(f"{self.path}:{n + 1} holds a non-finite number ({err}); delete that "
                                     "line to recompute it") from None
            if not isinstance(rec, dict) or key not in rec:
                raise InvalidInput(f"{self.path}:{n + 1} is not a record with a {key!r} field")
            self.records[str(rec[key])] = rec
        if torn:  # so appends start on a fresh line
            write_atomic(self.path, "".join(dumps_finite(r) + "\n" for r in self.records.values()))

    def __contains__(self, key) -> bool:
        return str(key) in self.records

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[dict]:
        return iter(self.records.values())

    def add(self, record: dict) -> None:
        if self.key not in record:
            raise KeyError(f"record has no {self.key!r} field: {sorted(record)}")
        line = dumps_finite(record) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.records[str(record[self.key])] = record


def content_fingerprint(path: str | Path) -> str:
    """A short hash of a file or a directory's files (relative name, size, first and last MiB of
    each): cheap for 7B checkpoints and large corpora, and different for edited or swapped content."""
    import hashlib

    path = Path(path)
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file()
                                                 and not any(p.startswith(".") for p in f.relative_to(path).parts))
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.relative_to(path) if f != path else f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 1 << 20:
                fh.seek(max(1 << 20, size - (1 << 20)))
                h.update(fh.read())
    return h.hexdigest()[:16]


def model_fingerprint(model_dir: str | Path) -> str:
    """`content_fingerprint` of what defines a model: a HF directory's config.json and weights, or a
    GGUF file (config, tokenizer and weights in one)."""
    import hashlib

    model_dir = Path(model_dir)
    if model_dir.is_file():
        return content_fingerprint(model_dir)
    files = sorted(model_dir.glob("config.json")) + sorted(model_dir.glob("*.safetensors")) + sorted(
        model_dir.glob("pytorch_model*.bin"))
    return hashlib.sha256("".join(f"{f.name}={content_fingerprint(f)}" for f in files).encode()).hexdigest()[:16]


# Options that never change a result: where results go and how errors are shown. (--model is in
# every identity as the weights' fingerprint: the same weights moved elsewhere are the same model.)
PRESENTATION = frozenset({"out", "debug", "compare_default", "model"})


def options_of(args: argparse.Namespace | Mapping, *, policy_keyed: bool = True, files: Iterable[str] = (),
               selection: Iterable[str] = ()) -> dict:
    """The parsed options (or a suite's keyword arguments) that change results, as `{"--flag": value}`,
    for `claim_results_dir`.

    `policy_keyed`: the suite keys each record by its policy's full description
    (`Policy.describe()`, every parameter), so `--policy`, `--compare`, `--budget` and the policy
    options are in the records rather than here, and a `--compare` list may grow across reruns.
    `files`: options naming files or directories whose *content* counts: each gets a fingerprint.
    `selection`: options that only choose which records are computed or shown (lengths, depths,
    sample counts) when each record's key names its own coordinates: a rerun asking for more of
    them resumes rather than being refused.
    """
    from kvjax.experiments.policy_options import POLICY_OPTIONS

    skip = set(PRESENTATION) | set(selection)
    files = {*files, "gate_params"}  # trained gates change what the gate policy keeps
    if policy_keyed:
        skip |= set(POLICY_OPTIONS) | {"policy", "compare", "budget", "default_budget", "recompress_every", "kv_bits", "kv_group",
                 "kv_residual"}
    out = {}
    for name, value in sorted((args if isinstance(args, Mapping) else vars(args)).items()):
        if name in skip or name.startswith("_"):  # "_typed_flags": how options were spelled, not what they are
            continue
        flag = "--" + name.replace("_", "-")
        out[flag] = _plain(value)
        if name in files and value is not None:
            paths = value if isinstance(value, (list, tuple)) else [value]
            out[flag + " content"] = [content_fingerprint(v) if Path(v).exists() else None for v in paths]
    return out


def training_identity(args: argparse.Namespace | Mapping, *, models: Iterable[str] = (), files: Iterable[str] = (),
                      skip: Iterable[str] = ()) -> dict:
    """What shapes a training run besides its `TrainConfig` (`kvjax.train.train`'s `identity`): every
    option but where results go and how they are shown, and the *content* of the starting weights
    (`models`: options naming a model) and of data files (`files`)."""
    from kvjax.models.loading import resolve

    values = dict(args if isinstance(args, Mapping) else vars(args))
    out = {}
    for name, value in sorted(values.items()):
        if name in {"out", "debug", "save_every", "no_eval", *skip} or name.startswith("_"):
            continue
        out["--" + name.rstrip("_").replace("_", "-")] = _plain(value)
        if value is None:
            continue
        if name in models:
            out[f"--{name.rstrip('_').replace('_', '-')} weights"] = model_fingerprint(resolve(value))
        if name in files:
            paths = value if isinstance(value, (list, tuple)) else [value]
            out[f"--{name.rstrip('_').replace('_', '-')} content"] = [content_fingerprint(v) for v in paths]
    return out


def _plain(value):
    return json.loads(json.dumps(value, default=str))


def claim_results_dir(out: str | Path, lm, options: dict) -> dict:
    """Ties OUT's resumable records to the whole configuration that produces them: kvjax's source (a digest of its
    files, so an edited policy never resumes into the records of the code before it), the model as it is in memory
    (its class, config and weights digest: `kvjax.experiments.identity`, never a path that may not hold it), its
    dtype and attention implementation, and `options` (from `options_of`). A rerun with the same identity resumes;
    one that differs in anything is refused, naming each differing option with both values, so one table never
    mixes two configurations. A claim that fails leaves nothing behind in a directory it created."""
    import kvjax
    from kvjax.experiments.identity import model_identity, source_digest

    out = Path(out)
    # Python's version too: the default texts (pydoc topics, the stdlib corpus) come with it. Everything is
    # computed before OUT is touched: an error here writes nothing.
    path = getattr(lm, "path", None)
    identity = {"kvjax": kvjax.__version__, "kvjax source": source_digest(),
                "python": ".".join(platform.python_version_tuple()[:2]),
                "model": None if path is None else shown(path), **model_identity(lm.model),
                "model dtype": str(getattr(lm.model, "dtype", "")),
                "attention impl": getattr(getattr(lm, "config", None), "attention_impl", "xla"), **_plain(options)}
    created = not out.exists()
    lock_results_dir(out)
    try:
        return _claim(out, identity)
    except BaseException:
        if created:
            locks.release(out, remove_empty=True)
        raise


def _claim(out: Path, identity: dict) -> dict:
    path = out / "identity.json"
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(old, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            raise InvalidInput(f"{path} is unreadable ({err}); it was torn or edited: delete {out} or pass "
                               "a new --out") from None
        # The model's path may move or be none (a model built in memory); its digests say whether it is the same.
        diff = [k for k in sorted(old.keys() | identity.keys()) if k != "model" and old.get(k) != identity.get(k)]
        if diff and not _holds_results(out):
            # claimed by a run that stopped before its first record (a bad option found later): nothing to keep
            write_atomic(path, json.dumps(identity, indent=2) + "\n")
            return identity
        if diff:
            changes = "; ".join(f"{k}: {_show(old, k)} -> {_show(identity, k)}" for k in diff)
            raise InvalidInput(f"{out} holds results of another configuration ({changes}); pass a new --out "
                               f"or delete {out}")
        return old
    write_atomic(path, json.dumps(identity, indent=2) + "\n")
    return identity


_OWN_FILES = {"identity.json", LOCK_NAME}


def _holds_results(out: Path) -> bool:
    return any(f.is_file() and f.name not in _OWN_FILES for f in out.rglob("*"))


def lock_results_dir(out: Path) -> None:
    """Makes `out` this process's for the rest of its life (an exclusive `flock` on OUT/.kvjax.lock), after
    checking that it is a directory kvjax may write into: a second run on the same OUT is refused naming
    the process that holds it, and a directory of the user's own files (no identity.json) is never written
    into. Idempotent within a process; let go at exit, the lock file with it (`kvjax.locks`)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InvalidInput(f"--out {out} is a file, not a directory; pass a directory for the results")
    if out.is_symlink() and not out.exists():
        raise InvalidInput(f"--out {out} is a symbolic link that loops or leads nowhere (to {os.readlink(out)}); pass "
                           "a directory for the results")
    try:
        key = out.resolve()
    except (RuntimeError, OSError) as err:  # a loop further up: RuntimeError until Python 3.13, OSError (ELOOP) after
        raise InvalidInput(f"--out {out} cannot be resolved: a symbolic link on its path loops ({err})") from None
    if locks.holds(key):
        return
    # kvjax's directories carry their own identity.json (a report's too: it claims its folder before its sections
    # claim theirs); one with files and none of its own is the user's, whatever its subfolders hold (an old run's
    # folder copied into the user's notes does not make the notes kvjax's)
    if out.is_dir() and not (out / "identity.json").is_file() and any(p.name != LOCK_NAME for p in out.iterdir()):
        names = sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME)
        raise InvalidInput(f"--out {out} holds files kvjax did not write ({', '.join(names[:4])}"
                           f"{', ...' if len(names) > 4 else ''}) and no identity.json: kvjax never writes into a "
                           "directory it did not create; pass a new or empty --out")
    locks.hold(out)


def _show(identity: dict, key: str) -> str:
    return repr(identity[key]) if key in identity else "(not recorded)"
