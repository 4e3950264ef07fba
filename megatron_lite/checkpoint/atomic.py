"""Atomic file writes: a reader sees the old file (or directory) or the complete new one, never a torn one.
Plain file operations, apart from the tensor format (format.py), so a writer of other files (the data tools'
indexed datasets and caches) does not import torch for them."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def private_temp(path: str) -> str:
    """A temporary name for `path` of this writer's own: where file locks hold on one node only, nodes writing
    one cache at once truncated each other's one shared temporary file (a review of multi-node runs)."""
    return f"{path}.{socket.gethostname()}.{os.getpid()}.partial"


def remove_stale_temps(path: str, age_s: float = 60.0) -> list[str]:
    """Remove `path`'s temporary files that writers on this host left when killed: a preprocessing run stopped by
    SIGKILL or a time limit left a file as large as its output, every retry one more. A file goes when its
    process is gone, no writer holds a lock on it (hold_temp: a process in another PID namespace, a container on
    the host's network, looks gone) and it has not changed for `age_s`. Other hosts' files are left: their
    writers cannot be seen from here. Returns the paths removed."""
    host, removed, now = socket.gethostname(), [], time.time()
    folder = os.path.dirname(path) or "."
    start = f"{os.path.basename(path)}.{host}."
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        pid, full = name[len(start) : -len(".partial")], os.path.join(folder, name)
        if not (name.startswith(start) and name.endswith(".partial") and pid.isdigit()) or _alive(int(pid)):
            continue
        try:
            if now - os.path.getmtime(full) < age_s:
                continue
            lock = hold_temp(full)
            if lock is None:  # (a writer holds it, or this file system has no locks: left alone)
                continue
            lock.close()
            os.remove(full)
            removed.append(full)
        except OSError:  # (removed by another process first, no permission, no locks here: left alone)
            pass
    return removed


def hold_temp(path: str):
    """An open file holding a lock on `path` (a writer's temporary file) while it is open, or None where the file
    system has no locks: remove_stale_temps leaves a held file alone."""
    f = open(path, "rb")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process)
        return True
    return True


def atomic_write(path: str, write) -> None:
    """Write through `write(tmp_path)`, fsync, then rename into place: a reader sees the old file or the
    complete new one, never a torn one (and two writers of one path never share a temporary file)."""
    tmp = private_temp(path)
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def atomic_write_json(path: str, obj) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)

    atomic_write(path, write)


def atomic_write_text(path: str, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    atomic_write(path, write)


def replace_dir(tmp: str, final: str) -> None:
    """Move a fully written directory into place (replacing an older copy of the same iteration)."""
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(os.path.dirname(final))
