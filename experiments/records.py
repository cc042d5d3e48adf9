"""Append-only JSON-lines result logs: an interrupted evaluation resumes without losing finished work."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


class ResultLog:
    """Records keyed by `key` (a field every record has), one JSON object per line.

    Each record is flushed as soon as it is added, so a crash loses at most the record being
    written; a torn last line (the crash happened mid-write) is ignored and recomputed.
    """

    def __init__(self, path: str | Path, key: str = "id"):
        self.path, self.key = Path(path), key
        self.records: dict[str, dict] = {}
        if self.path.is_file():
            lines = self.path.read_text().splitlines()
            for n, line in enumerate(lines):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    if n == len(lines) - 1:
                        break  # torn by a crash: drop it, it will be recomputed
                    raise ValueError(f"{self.path}:{n + 1} is not valid JSON") from None
                self.records[str(rec[key])] = rec
            # Rewrite without the torn line so appends start on a fresh line.
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records.values()))

    def __contains__(self, key) -> bool:
        return str(key) in self.records

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[dict]:
        return iter(self.records.values())

    def add(self, record: dict) -> None:
        if self.key not in record:
            raise KeyError(f"record has no {self.key!r} field: {sorted(record)}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.records[str(record[self.key])] = record


def model_fingerprint(model_dir: str | Path) -> str:
    """A short hash of a HF directory's config.json and weight files (name, size, first and last MiB):
    cheap for 7B checkpoints, and different for retrained or swapped weights."""
    import hashlib

    model_dir = Path(model_dir)
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("config.json")) + sorted(model_dir.glob("*.safetensors")) + sorted(
            model_dir.glob("pytorch_model*.bin")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 1 << 20:
                fh.seek(max(1 << 20, size - (1 << 20)))
                h.update(fh.read())
    return h.hexdigest()[:16]


def claim_results_dir(out: str | Path, lm, **inputs) -> None:
    """Ties OUT's resumable records to what produced them: the model's weights and dtype, and `inputs`
    (data files, ...). A rerun with the same identity resumes; one with another is refused, so records
    of two models (or datasets) are never mixed in one table."""
    out = Path(out)
    identity = {"model": str(lm.path), "weights": model_fingerprint(lm.path),
                "dtype": str(getattr(lm.model, "dtype", "")), **{k: str(v) for k, v in inputs.items()}}
    path = out / "identity.json"
    if path.is_file():
        old = json.loads(path.read_text())
        diff = [k for k in sorted(old.keys() | identity.keys()) if k != "model" and old.get(k) != identity.get(k)]
        if diff:
            changes = "; ".join(f"{k}: {old.get(k)!r} -> {identity.get(k)!r}" for k in diff)
            raise ValueError(f"{out} holds results of another run ({changes}); pass a new --out or delete {out}")
        return
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(identity, indent=2) + "\n")
