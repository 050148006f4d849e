"""The audit log: one JSON line per decision in $KEYVEIL_HOME/audit/.

Fields are those of SPEC §8. A line holds names, counts, the host and the
sealed path without its query: never a value and never a raw query string.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from datetime import UTC, datetime
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("keyveil.audit")


_FLUSH_SECONDS = 0.5
# One encoder for every line (json.dumps with separators builds a new one each call).
_encode = json.JSONEncoder(separators=(",", ":")).encode


def _timestamp(now: datetime) -> str:
    """NOW (UTC) as isoformat(timespec="milliseconds") writes it, with Z for +00:00, at a third of its cost."""
    return "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ" % (
        now.year, now.month, now.day, now.hour, now.minute, now.second, now.microsecond // 1000
    )


class AuditLog:
    """Appends records; a background thread flushes them twice a second,
    so writing a record costs no system call on the proxy's event loop."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._day = ""
        self._file = None
        self._dirty = False
        self._closed = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="keyveil-audit", daemon=True)
        self._flusher.start()

    def _flush_loop(self) -> None:
        while not self._closed.wait(_FLUSH_SECONDS):
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if self._dirty and self._file is not None:
                try:
                    self._file.flush()
                except OSError as e:
                    log.error("keyveil: cannot write the audit log in %s: %s", self.directory, e)
                self._dirty = False

    def _handle(self, now: datetime):
        day = "%04d-%02d-%02d" % (now.year, now.month, now.day)  # the UTC day of the record
        if day != self._day or self._file is None:
            if self._file:
                self._file.close()
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            path = self.directory / f"audit-{day}.jsonl"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._file = os.fdopen(fd, "a", encoding="utf-8")
            self._day = day
        return self._file

    def write(
        self,
        *,
        flow: str,
        client: str,
        method: str,
        host: str,
        path: str,
        action: str,
        names: Mapping[str, int] | None = None,
        code: str | None = None,
        agent: str | None = None,
    ) -> None:
        names = dict(names or {})
        now = datetime.now(UTC)
        record = {
            "ts": _timestamp(now),
            "flow": flow,
            "client": client,
            "method": method,
            "host": host,
            "path": path.split("?", 1)[0],
            "action": action,
            "names": sorted(names),
            "counts": names,
            "code": code,
            "agent": agent,
        }
        line = _encode(record)
        try:
            with self._lock:
                self._handle(now).write(line + "\n")
                self._dirty = True
        except OSError as e:
            log.error("keyveil: cannot write the audit log in %s: %s", self.directory, e)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self._file:
                self._file.close()
                self._file = None


def read_records(directory: Path) -> list[dict]:
    records = []
    for path in sorted(directory.glob("audit-*.jsonl")):
        with path.open(encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
    return records
