"""Two runs never share an output directory: an exclusive `flock` on OUT/.kvjax.lock for the life of the process.

`hold(out)` takes it (a second process is refused naming the holder: its pid, host and start time); the lock file
goes when the holder lets go (`release`, and at exit), so no stale lock file is left to mislead a reader. Used by
every suite's results directory (`kvjax.experiments.records.lock_results_dir`) and by every training run
(`kvjax.train.train`'s `out_dir`). Advisory locks on a local filesystem (Linux `flock`); a directory on a network
filesystem that ignores them is not protected.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import socket
import time
from pathlib import Path

from kvjax.errors import InvalidInput

LOCK_NAME = ".kvjax.lock"
_HELD: dict[Path, int] = {}  # directories this process holds, and their lock files' descriptors


def holds(out: str | Path) -> bool:
    """Whether this process holds `out`."""
    return Path(out).resolve() in _HELD


def hold(out: str | Path) -> None:
    """Makes `out` (created if missing) this process's until it exits or `release`s it; an `InvalidInput` naming
    the holder if another process has it. Idempotent within a process."""
    out = Path(out)
    key = out.resolve()
    if key in _HELD:
        return
    while True:
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError as err:
            raise InvalidInput(f"--out {out} cannot be written ({err.strerror}); pass a writable --out") from None
        except OSError as err:
            raise InvalidInput(f"--out {out} cannot be created ({err.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise InvalidInput(f"--out {out} is in use by {holder}: two runs never share an --out; wait for it to "
                               "finish or pass another --out") from None
        # The holder removes the lock file as it lets go: a file opened just before that is one nobody else will
        # lock again, so the lock is kept only on the file the path names now
        try:
            if os.fstat(fd).st_ino == os.stat(out / LOCK_NAME).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
    _HELD[key] = fd


def release(out: str | Path, *, remove_empty: bool = False) -> None:
    """Lets go of `out` if this process holds it: its lock file removed while still locked (no other run can take a
    lock on a file about to vanish), then unlocked; with `remove_empty`, `out` itself if nothing is left in it (a
    claim that failed in a directory it created)."""
    key = Path(out).resolve()
    fd = _HELD.pop(key, None)
    if fd is None:
        return
    (key / LOCK_NAME).unlink(missing_ok=True)
    os.close(fd)
    if remove_empty:
        try:
            key.rmdir()
        except OSError:  # not empty: the user's or an earlier run's files stay
            pass


@atexit.register
def _release_all() -> None:
    for key in list(_HELD):
        release(key)


__all__ = ["LOCK_NAME", "hold", "holds", "release"]
