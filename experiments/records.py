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
