"""Keeps a running proxy's view of the vault current, and says when it may not be trusted.

``VaultWatcher`` holds the last good ``VaultSnapshot`` of one vault. Every
``poll_seconds`` it asks the vault's cheap ``fingerprint()`` and calls
``load()`` only when that changed (or when the last read failed, or some
entries could not be read). The proxy asks ``snapshot(now)`` on every flow:
it gets the last good snapshot, or ``VaultUnavailable`` once the vault has
been unreadable for longer than ``grace_seconds``.

Local vaults (a file, the OS keyring, the environment) are checked inline,
from ``snapshot`` itself, as before: a ``stat`` costs microseconds and an
unreadable local vault blocks at once (grace 0). A remote store is read by a
background thread: a slow or unreachable server never stalls the proxy's
event loop, whose hooks only read the last result. The snapshot handed out
is immutable and replaced whole, so the hook and the thread share nothing
but one reference under a lock.

Nothing here logs or raises a value: messages come from the vault's own
errors, which name entries and addresses only.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from .._errors import KeyveilError, VaultUnavailable
from ._base import Vault, VaultSnapshot

log = logging.getLogger("keyveil")


class VaultWatcher:
    def __init__(
        self,
        vault: Vault,
        *,
        poll_seconds: float | None = None,
        grace_seconds: float | None = None,
        background: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.vault = vault
        self.poll_seconds = float(poll_seconds if poll_seconds is not None else getattr(vault, "poll_seconds", 1.0))
        self.grace_seconds = float(grace_seconds if grace_seconds is not None else getattr(vault, "grace_seconds", 0.0))
        self.background = bool(background if background is not None else getattr(vault, "remote", False))
        self._clock = clock
        self._lock = threading.Lock()
        self._snapshot: VaultSnapshot | None = None
        self._fingerprint: str | None = None
        self._error: VaultUnavailable | None = None
        self._good_at = -math.inf  # when the vault last answered in full
        self._checked = -math.inf
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> VaultSnapshot:
        """Read the vault once, now; VaultUnavailable if it cannot be read (the
        proxy then refuses to start). A remote vault is then polled in the background."""
        now = self._clock()
        fingerprint = self.vault.fingerprint()
        snapshot = self.vault.load()
        with self._lock:
            self._snapshot, self._fingerprint, self._good_at, self._checked = snapshot, fingerprint, now, now
        _report_unavailable(snapshot)
        if self.background and self._thread is None:
            self._thread = threading.Thread(target=self._poll_loop, name="keyveil-vault", daemon=True)
            self._thread.start()
        return snapshot

    def close(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)  # a daemon: one stuck in a slow read is left to end with the process

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            self.refresh(self._clock())

    # -- the two halves: reading the vault, and handing out what was read ---------

    def refresh(self, now: float) -> None:
        """One check of the vault (this is the I/O half): reload it if it changed."""
        with self._lock:
            fingerprint, failing, partial = self._fingerprint, self._error is not None, bool(
                self._snapshot and self._snapshot.unavailable
            )
        try:
            latest = self.vault.fingerprint()
            snapshot = None
            if latest != fingerprint or failing or partial:
                snapshot = self.vault.load()
        except KeyveilError as e:
            error = e if isinstance(e, VaultUnavailable) else VaultUnavailable(str(e))
            with self._lock:
                first = self._error is None or str(self._error) != str(error)
                self._error = error
            if first:
                if self.grace_seconds > 0:
                    log.error(
                        "keyveil: the vault cannot be read: %s; serving the values read %.0f s ago for up to %.0f s, "
                        "then every flow is blocked until it answers",
                        error, max(0.0, now - self._good_at), self.grace_seconds,
                    )
                else:
                    log.error("keyveil: the vault cannot be read: %s; every flow is blocked until it is readable", error)
            return
        except Exception as e:  # noqa: BLE001 - a bug in a backend must fail closed, not kill the thread
            with self._lock:
                self._error = VaultUnavailable(f"reading the vault failed ({type(e).__name__})")
            log.error("keyveil: reading the vault failed (%s)", type(e).__name__)
            return
        with self._lock:
            recovered = self._error is not None
            self._error = None
            self._good_at = now
            self._fingerprint = latest
            before = self._snapshot
            if snapshot is not None and snapshot == before:
                snapshot = None  # the same values: keep the object, so the proxy does not recompile
            if snapshot is not None:
                self._snapshot = snapshot
        if recovered:
            log.info("keyveil: the vault is readable again")
        if snapshot is not None:
            _report_unavailable(snapshot, before)

    def snapshot(self, now: float, force: bool = False) -> VaultSnapshot:
        """The values to use now, or VaultUnavailable (this half only reads memory,
        except for a local vault that is due for its inline check, and FORCE: a
        `keyveil secret` command changed the vault, read it again now)."""
        if force or (not self.background and now - self._checked >= self.poll_seconds):
            self._checked = now
            self.refresh(now)
        with self._lock:
            snapshot, error, good_at = self._snapshot, self._error, self._good_at
        if snapshot is None:
            raise VaultUnavailable("the vault has not been read yet")
        age = now - good_at
        if error is not None and age >= self.grace_seconds:
            raise error
        if self.background and age > self.grace_seconds + self.poll_seconds + 5:
            # The poller itself is stuck (a read that never returns): fail closed all the same.
            raise VaultUnavailable(f"the vault has not answered for {age:.0f} s")
        return snapshot


def _report_unavailable(snapshot: VaultSnapshot, before: VaultSnapshot | None = None) -> None:
    """Log entries that became unreadable (names and value-free reasons only).

    A warning, not an error: the proxy runs on, and mitmdump would refuse to
    start on an error logged during start-up."""
    known = before.unavailable if before is not None else {}
    for name, reason in sorted(snapshot.unavailable.items()):
        if known.get(name) != reason:
            log.warning("keyveil: %s cannot be read: %s; flows that need it are blocked", name, reason)
    for name in sorted(set(known) - set(snapshot.unavailable)):
        log.info("keyveil: %s can be read again", name)
