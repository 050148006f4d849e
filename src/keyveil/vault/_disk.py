"""Local-disk helpers of the vault: a private folder, a lock between keyveil
processes, and atomic replacement of a file.

They write only what they are given, with mode 0600 / 0700; errors name
paths and the OS reason, never the data.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .._errors import VaultError


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Serialise read-modify-write of the vault between keyveil processes."""
    ensure_private_dir(directory)
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; last writer wins
        yield
        return
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure_private_dir(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
    except OSError as e:
        raise VaultError(f"cannot create the vault directory {directory}: {e.strerror}") from None


def atomic_write(path: Path, data: bytes) -> None:
    """Replace PATH with DATA (mode 0600) so that a reader sees the old or the new file, whole."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise VaultError(f"cannot write the vault {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.chmod(tmp, 0o600)  # mkstemp's mode already, but not on every platform
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise VaultError(f"cannot write the vault {path}: {e.strerror}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable
        with contextlib.suppress(OSError):
            dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
