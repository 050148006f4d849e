"""The `openbao` backend: values in OpenBao (or HashiCorp Vault) KV version 2.

One KV entry per secret NAME at ``MOUNT/PREFIX + NAME`` (defaults ``secret``
and ``keyveil/``), the value in its field ``value``; the entry's KV versions
are the rotation history (SPEC §3, §9): the newest live version is the
current value, older versions retired less than ``RETENTION`` ago are
sealed and scrubbed but never injected. Whoever writes a new version (the
``bao`` CLI, a rotation job, ``keyveil secret set``) rotates the secret.

HTTP API relied on (the same in OpenBao and HashiCorp Vault):

- ``GET|POST /v1/MOUNT/data/PATH`` (read a version, write with ``cas``),
  ``GET|DELETE /v1/MOUNT/metadata/PATH``, ``LIST /v1/MOUNT/metadata/PATH``;
- ``SCAN /v1/MOUNT/detailed-metadata/PREFIX`` (OpenBao ≥ 2.1): every
  entry's version metadata in one response. That is the cheap change check
  a running proxy makes every poll. A server without it (HashiCorp Vault
  answers 405) is walked with LIST plus one metadata read per entry instead;
- ``auth/token/lookup-self``, ``auth/token/renew-self``,
  ``auth/approle/login``, ``auth/kubernetes/login``.

Values are read once per (entry, version) and then kept in this process's
memory only: nothing is ever written to local disk, and a request through
the proxy never waits for the store. The connection to ``BAO_ADDR`` is
direct, whatever ``HTTPS_PROXY`` says (keyveil must not route its own store
traffic through itself). No value, token, secret ID or JWT is ever put in a
message, a log line or a repr: errors name the address, the mount, the path
and an HTTP status.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from .._errors import UsageError, ValueRefused, VaultError, VaultUnavailable
from .._references import check_name
from . import _base
from ._base import RETENTION, SecretInfo, VaultSnapshot, check_value, checked_name

log = logging.getLogger("keyveil")

T = TypeVar("T")

ADDR_VARS = ("BAO_ADDR", "VAULT_ADDR")
TOKEN_VARS = ("BAO_TOKEN", "VAULT_TOKEN")
CACERT_VARS = ("BAO_CACERT", "VAULT_CACERT")
NAMESPACE_VARS = ("BAO_NAMESPACE", "VAULT_NAMESPACE")
K8S_JWT_DEFAULT = "/var/run/secrets/kubernetes.io/serviceaccount/token"
AUTH_METHODS = ("token", "approle", "kubernetes")

#: defaults: a new version is in force within POLL + TIMEOUT (≤ 5 s)
POLL_SECONDS = 2.0
TIMEOUT_SECONDS = 3.0
GRACE_SECONDS = 60.0

_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")


# --- settings ----------------------------------------------------------------


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        if env.get(name):
            return name, env[name]
    return None


def _seconds(env: Mapping[str, str], var: str, default: float, low: float, high: float) -> float:
    text = env.get(var)
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not low <= seconds <= high:
        raise VaultUnavailable(f"{var} must be a number of seconds from {low:g} to {high:g}, got {text!r}")
    return seconds


def _path_part(var: str, text: str, *, folder: bool) -> str:
    """MOUNT or PREFIX, checked: segments like secret names, so a path is never ambiguous."""
    stripped = text.strip("/")
    if not stripped:
        if folder:
            return ""
        raise VaultUnavailable(f"{var} is empty: name the KV version 2 mount, e.g. secret")
    for segment in stripped.split("/"):
        if not _SEGMENT.match(segment):
            raise VaultUnavailable(
                f"{var}={text!r}: each part must start with a letter or digit and hold only "
                "letters, digits, '.', '_' and '-'"
            )
    return stripped + "/" if folder else stripped


@dataclass(frozen=True)
class OpenBaoSettings:
    """Where the store is and how keyveil logs in, from the environment (SPEC §9)."""

    addr: str
    auth: str
    mount: str = "secret"
    prefix: str = "keyveil/"
    token: str | None = field(default=None, repr=False)
    token_var: str | None = None
    token_file: Path | None = None
    role_id_file: Path | None = None
    secret_id_file: Path | None = None
    approle_mount: str = "approle"
    k8s_role: str | None = None
    k8s_jwt_file: Path = Path(K8S_JWT_DEFAULT)
    k8s_mount: str = "kubernetes"
    ca_file: Path | None = None
    namespace: str | None = None
    poll_seconds: float = POLL_SECONDS
    grace_seconds: float = GRACE_SECONDS
    timeout: float = TIMEOUT_SECONDS

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OpenBaoSettings:
        env = os.environ if env is None else env
        addr = _first(env, ADDR_VARS)
        if addr is None:
            raise VaultUnavailable(
                "KEYVEIL_VAULT=openbao but neither BAO_ADDR nor VAULT_ADDR is set: set BAO_ADDR to the "
                "store's address, e.g. https://bao.internal:8200"
            )
        url = addr[1].rstrip("/")
        if not re.match(r"https?://[^/\s]+\Z", url):
            raise VaultUnavailable(f"{addr[0]}={addr[1]!r} is not an address like https://bao.internal:8200")
        token = _first(env, TOKEN_VARS)
        token_file = Path(env["KEYVEIL_BAO_TOKEN_FILE"]) if env.get("KEYVEIL_BAO_TOKEN_FILE") else None
        role_id = Path(env["KEYVEIL_BAO_ROLE_ID_FILE"]) if env.get("KEYVEIL_BAO_ROLE_ID_FILE") else None
        secret_id = Path(env["KEYVEIL_BAO_SECRET_ID_FILE"]) if env.get("KEYVEIL_BAO_SECRET_ID_FILE") else None
        k8s_role = env.get("KEYVEIL_BAO_K8S_ROLE") or None
        auth = env.get("KEYVEIL_BAO_AUTH") or (
            "token" if token or token_file else "approle" if role_id or secret_id else "kubernetes" if k8s_role else ""
        )
        if auth not in AUTH_METHODS:
            if not auth:
                raise VaultUnavailable(
                    "KEYVEIL_VAULT=openbao needs a way to log in: set BAO_TOKEN (or KEYVEIL_BAO_TOKEN_FILE), "
                    "or KEYVEIL_BAO_ROLE_ID_FILE and KEYVEIL_BAO_SECRET_ID_FILE for AppRole, or "
                    "KEYVEIL_BAO_K8S_ROLE for a Kubernetes service account"
                )
            raise VaultUnavailable(f"KEYVEIL_BAO_AUTH={auth!r}: use one of {', '.join(AUTH_METHODS)}")
        if auth == "token" and not (token or token_file):
            raise VaultUnavailable("KEYVEIL_BAO_AUTH=token but no token: set BAO_TOKEN or KEYVEIL_BAO_TOKEN_FILE")
        if auth == "approle" and not (role_id and secret_id):
            raise VaultUnavailable(
                "AppRole login needs both KEYVEIL_BAO_ROLE_ID_FILE and KEYVEIL_BAO_SECRET_ID_FILE (files holding "
                "the role ID and a secret ID)"
            )
        if auth == "kubernetes" and not k8s_role:
            raise VaultUnavailable("Kubernetes login needs KEYVEIL_BAO_K8S_ROLE: the role bound to this service account")
        ca = _first(env, CACERT_VARS)
        namespace = _first(env, NAMESPACE_VARS)
        return cls(
            addr=url,
            auth=auth,
            mount=_path_part("KEYVEIL_BAO_MOUNT", env.get("KEYVEIL_BAO_MOUNT") or "secret", folder=False),
            prefix=_path_part("KEYVEIL_BAO_PREFIX", env.get("KEYVEIL_BAO_PREFIX", "keyveil/"), folder=True),
            token=token[1] if token and auth == "token" else None,
            token_var=token[0] if token else None,
            token_file=token_file,
            role_id_file=role_id,
            secret_id_file=secret_id,
            approle_mount=_path_part("KEYVEIL_BAO_APPROLE_MOUNT", env.get("KEYVEIL_BAO_APPROLE_MOUNT") or "approle", folder=False),
            k8s_role=k8s_role,
            k8s_jwt_file=Path(env.get("KEYVEIL_BAO_K8S_JWT_FILE") or K8S_JWT_DEFAULT),
            k8s_mount=_path_part("KEYVEIL_BAO_K8S_MOUNT", env.get("KEYVEIL_BAO_K8S_MOUNT") or "kubernetes", folder=False),
            ca_file=Path(ca[1]) if ca else None,
            namespace=namespace[1] if namespace else None,
            poll_seconds=_seconds(env, "KEYVEIL_BAO_POLL_SECONDS", POLL_SECONDS, 0.1, 300),
            grace_seconds=_seconds(env, "KEYVEIL_BAO_GRACE_SECONDS", GRACE_SECONDS, 0, 86400),
            timeout=_seconds(env, "KEYVEIL_BAO_TIMEOUT_SECONDS", TIMEOUT_SECONDS, 0.1, 120),
        )


# --- what the store says about an entry -------------------------------------


@dataclass(frozen=True)
class _Version:
    created: datetime
    gone: bool  # deleted (its deletion time has passed) or destroyed: it cannot be read


@dataclass(frozen=True)
class _Entry:
    current: int
    versions: dict[int, _Version]

    def plan(self, now: datetime) -> tuple[int | None, list[int]]:
        """The version to inject (None when the newest is deleted) and the
        retained previous versions, newest first."""
        current = self.current if self.current in self.versions and not self.versions[self.current].gone else None
        numbers = sorted(self.versions)
        previous = []
        for i, number in enumerate(numbers[:-1]):
            if number >= self.current or self.versions[number].gone:
                continue
            retired = self.versions[numbers[i + 1]].created  # when a newer version replaced it
            if now - retired < RETENTION:
                previous.append(number)
        return current, previous[::-1]

    def key(self) -> list:
        return [self.current, [[n, v.created.isoformat(), v.gone] for n, v in sorted(self.versions.items())]]


_FRACTION = re.compile(r"(\.\d{6})\d+")


def _time(text: object) -> datetime | None:
    """An RFC 3339 time as the store writes it (nanoseconds, Z); None when empty."""
    if not isinstance(text, str) or not text:
        return None
    try:
        t = datetime.fromisoformat(_FRACTION.sub(r"\1", text).replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else None


def _entry(meta: object, now: datetime) -> _Entry | None:
    if not isinstance(meta, dict) or not isinstance(meta.get("versions"), dict):
        return None
    versions = {}
    for number, info in meta["versions"].items():
        try:
            n = int(number)
        except (TypeError, ValueError):
            continue
        if not isinstance(info, dict):
            continue
        created = _time(info.get("created_time"))
        if created is None:
            continue
        deleted = _time(info.get("deletion_time"))
        versions[n] = _Version(created, bool(info.get("destroyed")) or (deleted is not None and deleted <= now))
    current = meta.get("current_version")
    if not isinstance(current, int) or not versions:
        return None
    return _Entry(current, versions)


def _status(e: Exception) -> str:
    """The HTTP status an hvac exception stands for (hvac keeps only the class)."""
    import hvac.exceptions as x

    for cls, status in (
        (x.InvalidRequest, 400), (x.Unauthorized, 401), (x.Forbidden, 403), (x.InvalidPath, 404),
        (x.RateLimitExceeded, 429), (x.InternalServerError, 500), (x.VaultNotInitialized, 501),
        (x.BadGateway, 502), (x.VaultDown, 503),
    ):
        if isinstance(e, cls):
            return str(status)
    return "an unexpected status"


class _Unreadable(Exception):
    """One entry cannot be read; its reason is value-free."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _TokenRenewed(Exception):
    """The token was replaced mid-operation: run the operation again."""


# --- the backend -------------------------------------------------------------


class OpenBaoVault:
    """KV version 2 in OpenBao or HashiCorp Vault, through hvac."""

    backend = "openbao"
    remote = True

    def __init__(self, settings: OpenBaoSettings, *, listing: str = "auto") -> None:
        self.settings = settings
        self.poll_seconds = settings.poll_seconds
        self.grace_seconds = settings.grace_seconds
        #: "scan" (one SCAN per check), "list" (LIST + a metadata read per entry), "auto"
        self._listing_mode = listing
        self._lock = threading.RLock()
        self._client: Any = None
        self._token: str | None = None
        self._token_source = ""
        self._expires: float | None = None  # time.monotonic() when the token expires; None: never
        self._ttl = 0.0
        self._renewable = False
        self._listing: dict[str, _Entry] | None = None  # from the last fingerprint(), for the load() after it
        self._values: dict[tuple[str, int, str], bytes] = {}
        self._skipped: set[str] = set()

    @classmethod
    def from_env(cls) -> OpenBaoVault:
        return cls(OpenBaoSettings.from_env())

    def __repr__(self) -> str:
        s = self.settings
        return f"OpenBaoVault({s.addr!r}, mount={s.mount!r}, prefix={s.prefix!r}, auth={s.auth!r})"

    @property
    def where(self) -> str:
        return f"{self.settings.mount}/{self.settings.prefix}"

    def path(self, name: str) -> str:
        return self.settings.prefix + name

    # -- public API -------------------------------------------------------------

    def fingerprint(self) -> str:
        with self._lock:
            listing = self._call(self._list)
            self._listing = listing
            digest = hashlib.sha256(
                json.dumps({name: e.key() for name, e in sorted(listing.items())}, separators=(",", ":")).encode()
            )
            return digest.hexdigest()

    def load(self) -> VaultSnapshot:
        with self._lock:
            listing, self._listing = self._listing, None
            if listing is None:
                listing = self._call(self._list)
            return self._call(lambda: self._snapshot(listing))

    def info(self) -> list[SecretInfo]:
        with self._lock:
            listing = self._call(self._list)
            now = _base.now()
            out = []
            for name, entry in sorted(listing.items()):
                current, previous = entry.plan(now)
                if current is not None:
                    out.append(SecretInfo(name, 1 + len(previous), entry.versions[current].created))
            return out

    def set(self, name: str, value: bytes) -> None:
        name, value = checked_name(name), check_value(value)
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueRefused(
                "OpenBao keeps values as text and this value is not valid UTF-8: nothing was stored"
            ) from None
        with self._lock:
            self._call(lambda: self._write(name, text))

    def remove(self, name: str) -> None:
        name = checked_name(name)
        with self._lock:
            self._call(lambda: self._delete(name))

    # -- operations (run through _call: token kept fresh, errors translated) -----

    def _list(self) -> dict[str, _Entry]:
        mode = self._listing_mode
        if mode in ("auto", "scan"):
            listing = self._scan()
            if listing is not None:
                self._listing_mode = "scan"
                return listing
            if mode == "scan":
                raise VaultUnavailable(f"{self.settings.addr} does not support SCAN on {self.settings.mount}/detailed-metadata")
            log.info("keyveil: %s has no SCAN of KV metadata; listing entry by entry instead", self.settings.addr)
            self._listing_mode = "list"
        return self._walk()

    def _scan(self) -> dict[str, _Entry] | None:
        """Every entry's metadata in one SCAN; None when the server has no SCAN."""
        import hvac.utils

        url = f"/v1/{self.settings.mount}/detailed-metadata/{self.settings.prefix}"
        response = self._client.adapter.request("SCAN", url, raise_exception=False)
        if not isinstance(response, dict):
            status = response.status_code
            if response.ok:
                response = {}
            else:
                try:
                    errors = response.json().get("errors") or []
                except ValueError:
                    errors = []
                text = " ".join(str(e) for e in errors)
                if status == 405 or (status in (400, 404) and "unsupported" in text):
                    return None
                if status == 404:
                    self._check_mount(errors)
                hvac.utils.raise_for_error("SCAN", url, status, errors=errors or None)
        data = response.get("data") or {}
        info = data.get("key_info") or {} if isinstance(data, dict) else {}
        now = _base.now()
        listing = {}
        for key, meta in info.items():
            name = self._name(key)
            entry = _entry(meta, now) if name else None
            if entry is not None:
                listing[name] = entry
        return listing

    def _walk(self) -> dict[str, _Entry]:
        import hvac.exceptions

        kv = self._client.secrets.kv.v2
        mount, listing, folders = self.settings.mount, {}, [""]
        now = _base.now()
        while folders:
            folder = folders.pop()
            try:
                keys = kv.list_secrets(path=self.settings.prefix + folder, mount_point=mount)["data"]["keys"]
            except hvac.exceptions.InvalidPath as e:
                self._check_mount(e)
                continue  # an empty folder
            for key in keys:
                if key.endswith("/"):
                    folders.append(folder + key)
                    continue
                name = self._name(folder + key)
                if name is None:
                    continue
                try:
                    meta = kv.read_secret_metadata(path=self.path(name), mount_point=mount)["data"]
                except hvac.exceptions.InvalidPath:
                    continue  # removed meanwhile
                entry = _entry(meta, now)
                if entry is not None:
                    listing[name] = entry
        return listing

    def _name(self, key: str) -> str | None:
        try:
            return check_name(key)
        except ValueError:
            if key not in self._skipped:
                self._skipped.add(key)
                log.warning(
                    "keyveil: ignoring the entry %s%s: its name is not a valid secret name",
                    self.where, key.encode("ascii", "backslashreplace").decode()[:200],
                )
            return None

    def _snapshot(self, listing: dict[str, _Entry]) -> VaultSnapshot:
        now = _base.now()
        current: dict[str, bytes] = {}
        previous: dict[str, tuple[bytes, ...]] = {}
        unavailable: dict[str, str] = {}
        wanted = set()
        for name, entry in listing.items():
            cur, old = entry.plan(now)
            try:
                if cur is not None:
                    wanted.add((name, cur, entry.versions[cur].created.isoformat()))
                    value = self._value(name, cur, entry, current=True)
                    if value is not None:
                        current[name] = value
                kept = []
                for number in old:
                    wanted.add((name, number, entry.versions[number].created.isoformat()))
                    value = self._value(name, number, entry, current=False)
                    if value is not None:
                        kept.append(value)
                if kept:
                    previous[name] = tuple(kept)
            except _Unreadable as e:
                current.pop(name, None)
                unavailable[name] = e.reason
        # Values of versions no longer wanted (pruned, deleted, rm) leave memory.
        for key in set(self._values) - wanted:
            del self._values[key]
        return VaultSnapshot(current, previous, unavailable)

    def _value(self, name: str, number: int, entry: _Entry, *, current: bool) -> bytes | None:
        import hvac.exceptions

        key = (name, number, entry.versions[number].created.isoformat())
        if key in self._values:
            return self._values[key]
        where = f"{self.settings.mount}/{self.path(name)}"
        try:
            response = self._client.secrets.kv.v2.read_secret_version(
                path=self.path(name), version=number, mount_point=self.settings.mount, raise_on_deleted_version=True
            )
        except hvac.exceptions.InvalidPath:
            return None  # deleted since the listing: the next check sees it
        except hvac.exceptions.Forbidden:
            self._forbidden()
            raise _Unreadable(
                f"permission denied reading {where} (version {number}): grant read on "
                f"{self.settings.mount}/data/{self.path(name)} in the proxy's policy"
            ) from None
        data = (response.get("data") or {}).get("data") if isinstance(response, dict) else None
        text = data.get("value") if isinstance(data, dict) else None
        if not isinstance(text, str):
            if not current:
                return None
            raise _Unreadable(
                f"{where} has no text field 'value' (version {number}): store the secret there with "
                f"`keyveil secret set {name}` or `bao kv put {where} value=-` (value on stdin)"
            )
        try:
            value = check_value(text.encode("utf-8"))
        except ValueRefused as e:
            if not current:
                return None
            raise _Unreadable(f"{where} (version {number}) is refused: {e}") from None
        self._values[key] = value
        return value

    def _write(self, name: str, text: str) -> None:
        import hvac.exceptions

        kv, mount, path = self._client.secrets.kv.v2, self.settings.mount, self.path(name)
        try:
            meta = kv.read_secret_metadata(path=path, mount_point=mount)["data"]
            version = int(meta.get("current_version") or 0)
        except hvac.exceptions.InvalidPath as e:
            self._check_mount(e)
            meta, version = None, 0
        entry = _entry(meta, _base.now()) if meta else None
        if entry is not None:
            cur, _ = entry.plan(_base.now())
            if cur is not None:
                try:
                    old = kv.read_secret_version(path=path, version=cur, mount_point=mount, raise_on_deleted_version=True)
                    stored = old["data"]["data"].get("value")
                except (hvac.exceptions.InvalidPath, KeyError, TypeError, AttributeError):
                    stored = None
                if isinstance(stored, str) and hmac.compare_digest(stored.encode("utf-8"), text.encode("utf-8")):
                    return  # already the current value: no new version
        try:
            kv.create_or_update_secret(path=path, secret={"value": text}, cas=version, mount_point=mount)
        except hvac.exceptions.InvalidRequest as e:
            if "check-and-set" in " ".join(getattr(e, "errors", None) or []):
                raise VaultError(
                    f"{mount}/{path} was changed by someone else while keyveil wrote it: nothing was "
                    "stored; run the command again"
                ) from None
            raise

    def _delete(self, name: str) -> None:
        import hvac.exceptions

        kv, mount, path = self._client.secrets.kv.v2, self.settings.mount, self.path(name)
        try:
            kv.read_secret_metadata(path=path, mount_point=mount)
        except hvac.exceptions.InvalidPath as e:
            self._check_mount(e)
            raise UsageError(
                f"no secret named {name} in OpenBao at {mount}/{path}; `keyveil secret list` shows the names"
            ) from None
        # Every version at once, as `secret rm` does in the file vault: the user asked for the value to be gone.
        kv.delete_metadata_and_all_versions(path=path, mount_point=mount)

    # -- errors -------------------------------------------------------------------

    def _check_mount(self, e: Exception | list) -> None:
        """A 404 that says the mount itself is missing becomes a message saying so."""
        errors = " ".join(str(x) for x in (e if isinstance(e, list) else getattr(e, "errors", None) or []))
        if "no handler for route" in errors or "route entry not found" in errors:
            raise VaultUnavailable(
                f"{self.settings.addr} has no secrets engine mounted at {self.settings.mount}/: enable KV "
                f"version 2 there (`bao secrets enable -path={self.settings.mount} kv-v2`) or set KEYVEIL_BAO_MOUNT"
            ) from None

    def _call(self, operation: Callable[[], T]) -> T:
        """Run OPERATION with a fresh token, once more after a re-login, and turn
        transport and server errors into value-free VaultUnavailable / VaultError."""
        import hvac.exceptions
        import requests.exceptions

        addr = self.settings.addr
        for attempt in (1, 2):
            try:
                self._ensure_token()
                return operation()
            except _TokenRenewed:
                if attempt == 2:
                    raise VaultUnavailable(f"{addr} keeps refusing keyveil's new token: check the role's policies") from None
            except hvac.exceptions.Forbidden:
                if attempt == 1 and self._forbidden_retry():
                    continue
                raise VaultUnavailable(
                    f"{addr} denied keyveil access to {self.where} (403): the proxy's policy needs "
                    f"scan and list on {self.settings.mount}/detailed-metadata/{self.settings.prefix}*, list and "
                    f"read on {self.settings.mount}/metadata/{self.settings.prefix}* and read on "
                    f"{self.settings.mount}/data/{self.settings.prefix}* (docs/teams.md)"
                ) from None
            except requests.exceptions.SSLError:
                raise VaultUnavailable(
                    f"TLS to {addr} failed: its certificate is not trusted; set BAO_CACERT to the CA "
                    "file that signed it"
                ) from None
            except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as e:
                raise VaultUnavailable(
                    f"OpenBao at {addr} cannot be reached ({type(e).__name__}): check BAO_ADDR and that "
                    "the server is up"
                ) from None
            except (hvac.exceptions.VaultDown, hvac.exceptions.VaultNotInitialized):
                raise VaultUnavailable(f"OpenBao at {addr} is sealed or not initialised (503): unseal it") from None
            except hvac.exceptions.VaultError as e:
                status = _status(e)
                raise VaultUnavailable(
                    f"OpenBao at {addr} answered {status} ({type(e).__name__}) for {self.where}"
                ) from None
            except requests.exceptions.RequestException as e:
                raise VaultUnavailable(f"OpenBao at {addr}: the request failed ({type(e).__name__})") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _forbidden(self) -> None:
        """A 403 on one entry: if the token itself went bad, retry the whole operation."""
        if self._forbidden_retry():
            raise _TokenRenewed

    def _forbidden_retry(self) -> bool:
        """After a 403: True when the token was bad and has been replaced (run again);
        False when the token is fine and the policy denies; VaultUnavailable when a
        bad token cannot be replaced."""
        import hvac.exceptions

        try:
            self._client.auth.token.lookup_self()
            return False
        except hvac.exceptions.Forbidden:
            pass
        self._token = None
        self._ensure_token()  # logs in anew, or raises for a token that cannot be replaced
        return True

    # -- the token ---------------------------------------------------------------

    def _new_client(self) -> Any:
        import hvac
        import requests

        session = requests.Session()
        session.trust_env = False  # never through HTTPS_PROXY (it may be keyveil itself) nor netrc
        s = self.settings
        verify: bool | str = str(s.ca_file) if s.ca_file else True
        if s.ca_file and not s.ca_file.is_file():
            raise VaultUnavailable(f"the CA file {s.ca_file} (BAO_CACERT) does not exist")
        session.verify = verify  # hvac takes the session's setting over its own argument
        return hvac.Client(
            url=s.addr, token="", verify=verify, timeout=s.timeout, namespace=s.namespace, session=session,
        )

    def _ensure_token(self) -> None:
        if self._client is None:
            self._client = self._new_client()
        if self._token is None:
            self._login()
            return
        if self._expires is None:
            return
        remaining = self._expires - time.monotonic()
        if remaining > self._ttl / 2:
            return
        # Past half its life: renew it, or log in again when it cannot be renewed far enough.
        if self._renewable and self._renew():
            return
        if self.settings.auth != "token":
            self._login()
        elif self.settings.token_file is not None and self._read_token_file() != self._token:
            self._login()  # the file holds a newer token (a Vault/OpenBao agent rewrote it)
        elif remaining <= 0:
            self._token = None
            raise self._token_expired()

    def _renew(self) -> bool:
        """Renew the token; True when it now lives at least half as long as it did."""
        import hvac.exceptions
        import requests.exceptions

        try:
            auth = self._client.auth.token.renew_self()["auth"]
        except (hvac.exceptions.VaultError, requests.exceptions.RequestException, KeyError, TypeError):
            return False
        ttl = float(auth.get("lease_duration") or 0)
        self._renewable = bool(auth.get("renewable"))
        if ttl <= 0:
            return False
        self._expires = time.monotonic() + ttl
        if ttl < self._ttl / 2:
            # Capped by the token's max TTL: it is near its end.
            return self.settings.auth == "token"
        return True

    def _login(self) -> None:
        import hvac.exceptions

        s = self.settings
        client = self._client
        started = time.monotonic()
        if s.auth == "token":
            if s.token_file is not None:
                token, source = self._read_token_file(), f"the token file {s.token_file}"
            else:
                token, source = s.token, s.token_var or "BAO_TOKEN"
            client.token = token
            self._token, self._token_source = token, source
            try:
                data = client.auth.token.lookup_self()["data"]
            except hvac.exceptions.Forbidden:
                self._token = None
                raise self._token_expired() from None
            ttl = float(data.get("ttl") or 0)
            self._renewable = bool(data.get("renewable"))
        else:
            try:
                if s.auth == "approle":
                    role_id = self._read_file(s.role_id_file, "KEYVEIL_BAO_ROLE_ID_FILE")
                    secret_id = self._read_file(s.secret_id_file, "KEYVEIL_BAO_SECRET_ID_FILE")
                    auth = client.auth.approle.login(role_id=role_id, secret_id=secret_id, mount_point=s.approle_mount)["auth"]
                else:
                    jwt = self._read_file(s.k8s_jwt_file, "KEYVEIL_BAO_K8S_JWT_FILE")
                    auth = client.auth.kubernetes.login(role=s.k8s_role, jwt=jwt, mount_point=s.k8s_mount)["auth"]
            except (hvac.exceptions.InvalidRequest, hvac.exceptions.Forbidden, hvac.exceptions.Unauthorized) as e:
                self._token = None
                raise VaultUnavailable(self._login_refused(e)) from None
            except hvac.exceptions.InvalidPath:
                self._token = None
                mount = s.approle_mount if s.auth == "approle" else s.k8s_mount
                raise VaultUnavailable(
                    f"{s.addr} has no {s.auth} auth method at auth/{mount}: enable it, or set "
                    f"KEYVEIL_BAO_{'APPROLE' if s.auth == 'approle' else 'K8S'}_MOUNT"
                ) from None
            client.token = auth["client_token"]
            self._token, self._token_source = client.token, f"{s.auth} login"
            ttl = float(auth.get("lease_duration") or 0)
            self._renewable = bool(auth.get("renewable"))
        self._ttl = ttl
        self._expires = started + ttl if ttl > 0 else None

    def _login_refused(self, e: Exception) -> str:
        s = self.settings
        status = _status(e)
        if s.auth == "approle":
            return (
                f"AppRole login to {s.addr} (auth/{s.approle_mount}) was refused ({status}): check the role ID "
                f"in {s.role_id_file} and that the secret ID in {s.secret_id_file} is valid and not used up"
            )
        return (
            f"Kubernetes login to {s.addr} (auth/{s.k8s_mount}, role {s.k8s_role}) was refused ({status}): "
            f"check that the role binds this service account and that {s.k8s_jwt_file} holds its token"
        )

    def _token_expired(self) -> VaultUnavailable:
        return VaultUnavailable(
            f"the OpenBao token from {self._token_source or 'BAO_TOKEN'} is not valid (expired or revoked): "
            "give keyveil a new token, or log in with AppRole or Kubernetes, which keyveil renews by itself"
        )

    def _read_token_file(self) -> str:
        return self._read_file(self.settings.token_file, "KEYVEIL_BAO_TOKEN_FILE")

    @staticmethod
    def _read_file(path: Path | None, var: str) -> str:
        if path is None:
            raise VaultUnavailable(f"{var} is not set")
        try:
            text = path.read_text("utf-8").strip()
        except FileNotFoundError:
            raise VaultUnavailable(f"{path} ({var}) does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise VaultUnavailable(f"cannot read {path} ({var}): {getattr(e, 'strerror', None) or type(e).__name__}") from None
        if not text:
            raise VaultUnavailable(f"{path} ({var}) is empty")
        return text
