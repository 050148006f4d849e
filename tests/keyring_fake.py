"""A keyring backend for tests only: entries in memory, or in a JSON file.

Select it in a subprocess with ``PYTHON_KEYRING_BACKEND=keyring_fake.FileKeyring``
(``tests/`` on ``PYTHONPATH``) and ``KEYVEIL_TEST_KEYRING_FILE=PATH`` so that
processes share one keyring; in-process, ``keyring.set_keyring(FileKeyring(path))``.
It stores entries in plain text, which is why it must never leave tests/.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from keyring.backend import KeyringBackend
from keyring.errors import PasswordDeleteError

PATH_VAR = "KEYVEIL_TEST_KEYRING_FILE"


class FileKeyring(KeyringBackend):
    # Below the fail backend (0): importing this module must never make
    # keyring's auto-detection pick it for code that did not ask for it.
    priority = -2  # type: ignore[assignment]

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        path = path if path is not None else os.environ.get(PATH_VAR)
        self.path = Path(path) if path else None
        self._memory: dict[str, str] = {}

    def _load(self) -> dict[str, str]:
        if self.path is None:
            return dict(self._memory)
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}

    def _save(self, entries: dict[str, str]) -> None:
        if self.path is None:
            self._memory = dict(entries)
            return
        fd, tmp = tempfile.mkstemp(dir=self.path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, self.path)

    @staticmethod
    def _key(service: str, username: str) -> str:
        return f"{service}\x00{username}"

    def get_password(self, service: str, username: str) -> str | None:
        return self._load().get(self._key(service, username))

    def set_password(self, service: str, username: str, password: str) -> None:
        entries = self._load()
        entries[self._key(service, username)] = password
        self._save(entries)

    def delete_password(self, service: str, username: str) -> None:
        entries = self._load()
        if entries.pop(self._key(service, username), None) is None:
            raise PasswordDeleteError(f"no entry for {username!r}")
        self._save(entries)

    def usernames(self, service: str) -> list[str]:
        """Test helper: the users that have an entry under SERVICE."""
        prefix = service + "\x00"
        return sorted(k[len(prefix) :] for k in self._load() if k.startswith(prefix))
