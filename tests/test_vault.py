"""The vault: storage, rotation, key sources, and that no value leaks out of it."""

from __future__ import annotations

import base64
import json
import os
import secrets
import stat
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import keyring
import pytest
from keyring.backends import fail, null

try:
    import keyveil  # noqa: F401
except ImportError:  # running from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from keyring_fake import PATH_VAR, FileKeyring

import keyveil.vault
from keyveil.vault import _base
from keyveil._errors import UsageError, ValueRefused, VaultUnavailable
from keyveil.vault import (
    MIN_VALUE_LENGTH,
    RETENTION,
    VaultSnapshot,
    VaultWatcher,
    check_value,
    env_var,
    open_vault,
)

POSIX = os.name == "posix"
T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def fresh() -> bytes:
    """A fake value, new on every call and every run."""
    return b"kv-" + secrets.token_urlsafe(24).encode()


def forms(value: bytes) -> list[bytes]:
    """Ways a value could show up in a file that should not hold it."""
    b64 = base64.b64encode(value)
    url = base64.urlsafe_b64encode(value)
    return [value, b64, b64.rstrip(b"="), url, url.rstrip(b"="), value.hex().encode(), value.hex().upper().encode()]


def assert_no_value(blob: bytes | str, *values: bytes) -> None:
    data = blob.encode("utf-8", "surrogateescape") if isinstance(blob, str) else blob
    for value in values:
        for form in forms(value):
            assert form not in data, "a form of a value was found"
        assert repr(value).encode() not in data


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> None:
        self.now += timedelta(**delta)


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch):
    """No real keyring, no passphrase, no vault variables leak in from the host."""
    for var in list(os.environ):
        if var.startswith("KEYVEIL_"):
            monkeypatch.delenv(var)
    before = keyring.get_keyring()
    keyring.set_keyring(fail.Keyring())
    yield
    keyring.set_keyring(before)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(_base, "now", c)
    return c


@pytest.fixture
def fake_keyring(tmp_path: Path) -> FileKeyring:
    kr = FileKeyring(tmp_path / "keyring.json")
    keyring.set_keyring(kr)
    return kr


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def envelope(home: Path) -> dict:
    return json.loads((home / "vault" / "vault.json").read_text())


def all_vault_bytes(home: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted((home / "vault").iterdir()) if p.is_file())


# --- values ------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [b"", b"1234567", "ééééééé".encode(), b"x" * (MIN_VALUE_LENGTH - 1)],
    ids=["empty", "7-ascii", "7-chars-14-bytes", "min-1"],
)
def test_short_values_are_refused(value: bytes, home: Path) -> None:
    with pytest.raises(ValueRefused):
        check_value(value)
    with pytest.raises(ValueRefused):
        open_vault(home).set("a/b", value)
    assert not (home / "vault" / "vault.json").exists()


@pytest.mark.parametrize("value", [b"12345678", b"abc\x00defgh", "éééééééé".encode(), b"\xff" * 8])
def test_values_of_eight_characters_are_accepted(value: bytes) -> None:
    assert check_value(value) == value


def test_value_holding_a_reference_is_refused() -> None:
    with pytest.raises(ValueRefused, match="secret"):
        check_value(b"prefix-{{secret:github/pat}}")


def test_refusal_messages_hold_no_value() -> None:
    value = b"s3cr"
    with pytest.raises(ValueRefused) as e:
        check_value(value)
    assert "s3cr" not in str(e.value)


@pytest.mark.parametrize("name", ["", "../x", "a//b", "-a", "a" * 129, "a b"])
def test_bad_names_are_usage_errors(name: str, home: Path) -> None:
    with pytest.raises(UsageError):
        open_vault(home).set(name, fresh())


# --- file backend: round trip, rotation ------------------------------------


def test_round_trip(home: Path, clock: Clock) -> None:
    a, b = fresh(), fresh()
    vault = open_vault(home)
    assert vault.backend == "file"
    assert vault.load().current == {}
    vault.set("github/pat", a)
    vault.set("anthropic/key", b)

    snap = open_vault(home).load()  # a new instance reads the file back
    assert snap.current == {"github/pat": a, "anthropic/key": b}
    assert snap.previous == {}
    infos = open_vault(home).info()
    assert [(i.name, i.versions, i.updated) for i in infos] == [("anthropic/key", 1, T0), ("github/pat", 1, T0)]


def test_rotation_keeps_previous_for_retention_then_drops_it(home: Path, clock: Clock) -> None:
    old, new = fresh(), fresh()
    vault = open_vault(home)
    vault.set("github/pat", old)
    clock.advance(days=3)
    rotated_at = clock.now
    vault.set("github/pat", new)

    snap = vault.load()
    assert snap.current == {"github/pat": new}
    assert snap.previous == {"github/pat": (old,)}
    assert [(i.versions, i.updated) for i in vault.info()] == [(2, rotated_at)]

    clock.now = rotated_at + RETENTION - timedelta(seconds=1)
    assert vault.load().previous == {"github/pat": (old,)}

    clock.now = rotated_at + RETENTION
    assert vault.load().previous == {}
    assert vault.load().current == {"github/pat": new}
    assert [i.versions for i in vault.info()] == [1]


def test_expired_values_are_pruned_from_the_file_on_write(home: Path, clock: Clock) -> None:
    old = fresh()
    vault = open_vault(home)
    vault.set("github/pat", old)
    vault.set("github/pat", fresh())
    clock.advance(days=31)
    vault.set("other/x", fresh())  # any write prunes every secret

    clock.now = T0  # back in time: a value only hidden by the clock would reappear
    assert vault.load().previous == {}
    assert_no_value(all_vault_bytes(home), old)


def test_previous_values_are_newest_first(home: Path, clock: Clock) -> None:
    v1, v2, v3 = fresh(), fresh(), fresh()
    vault = open_vault(home)
    for v in (v1, v2, v3):
        vault.set("n", v)
        clock.advance(days=1)
    assert vault.load().previous == {"n": (v2, v1)}


def test_setting_the_same_value_is_a_no_op(home: Path, clock: Clock) -> None:
    value = fresh()
    vault = open_vault(home)
    vault.set("n", value)
    before = (home / "vault" / "vault.json").read_bytes()
    fp = vault.fingerprint()
    clock.advance(days=1)
    vault.set("n", value)
    assert (home / "vault" / "vault.json").read_bytes() == before
    assert vault.fingerprint() == fp
    assert [(i.versions, i.updated) for i in vault.info()] == [(1, T0)]


def test_rotating_back_to_a_previous_value_makes_it_current_only(home: Path, clock: Clock) -> None:
    a, b = fresh(), fresh()
    vault = open_vault(home)
    vault.set("n", a)
    vault.set("n", b)
    vault.set("n", a)
    snap = vault.load()
    assert snap.current == {"n": a}
    assert snap.previous == {"n": (b,)}


def test_remove_forgets_every_version(home: Path, clock: Clock) -> None:
    old, new, other = fresh(), fresh(), fresh()
    vault = open_vault(home)
    vault.set("n", old)
    vault.set("n", new)
    vault.set("keep", other)
    vault.remove("n")
    snap = vault.load()
    assert snap.current == {"keep": other}
    assert snap.previous == {}
    with pytest.raises(UsageError, match="no secret named n"):
        vault.remove("n")


def test_remove_unknown_on_empty_vault(home: Path) -> None:
    with pytest.raises(UsageError):
        open_vault(home).remove("nothing/here")


def test_fingerprint_changes_with_the_file(home: Path) -> None:
    vault = open_vault(home)
    seen = {vault.fingerprint()}
    vault.set("a", fresh())
    seen.add(vault.fingerprint())
    vault.set("a", fresh())
    seen.add(vault.fingerprint())
    vault.remove("a")
    seen.add(vault.fingerprint())
    assert len(seen) == 4


# --- file backend: what is on disk ------------------------------------------


@pytest.mark.skipif(not POSIX, reason="POSIX modes")
def test_file_and_directory_modes(home: Path) -> None:
    old = os.umask(0)  # a permissive umask must not loosen the vault
    try:
        open_vault(home).set("a", fresh())
    finally:
        os.umask(old)
    assert stat.S_IMODE((home / "vault").stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "vault" / "vault.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((home / "vault" / "key").stat().st_mode) == 0o600


@pytest.mark.skipif(not POSIX, reason="POSIX modes")
def test_loose_vault_directory_is_tightened_on_write(home: Path) -> None:
    (home / "vault").mkdir(parents=True, mode=0o755)
    os.chmod(home / "vault", 0o755)
    open_vault(home).set("a", fresh())
    assert stat.S_IMODE((home / "vault").stat().st_mode) == 0o700


def test_vault_files_hold_no_value(home: Path, clock: Clock) -> None:
    values = [fresh() for _ in range(3)]
    vault = open_vault(home)
    vault.set("a", values[0])
    vault.set("a", values[1])  # values[0] is now a previous value, still stored
    vault.set("b", values[2])
    assert set(vault.load().current.values()) | set(vault.load().previous["a"]) == set(values)
    assert_no_value(all_vault_bytes(home), *values)
    assert not [p for p in (home / "vault").iterdir() if p.name.endswith(".tmp")]


def test_envelope_format_and_fresh_nonce(home: Path) -> None:
    vault = open_vault(home)
    vault.set("a", fresh())
    first = envelope(home)
    vault.set("a", fresh())
    second = envelope(home)
    assert first["format"] == "keyveil-vault"
    assert first["version"] == 1
    assert first["key_source"] == "keyfile"
    assert len(base64.b64decode(first["nonce"])) == 12
    assert first["nonce"] != second["nonce"]


def _rewrite(home: Path, **changes: object) -> None:
    data = envelope(home)
    data.update(changes)
    (home / "vault" / "vault.json").write_text(json.dumps(data))


def _flip_last_byte(text: str) -> str:
    raw = bytearray(base64.b64decode(text))
    raw[-1] ^= 1
    return base64.b64encode(bytes(raw)).decode()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda home: (home / "vault" / "vault.json").write_bytes(b"\x00\xffnot json"),
        lambda home: (home / "vault" / "vault.json").write_text('{"format": "keyveil-vault", "vers'),
        lambda home: (home / "vault" / "vault.json").write_text("[]"),
        lambda home: _rewrite(home, format="something-else"),
        lambda home: _rewrite(home, nonce="***"),
        lambda home: _rewrite(home, ciphertext=_flip_last_byte(envelope(home)["ciphertext"])),
        lambda home: _rewrite(home, key_source="passphrase", salt=base64.b64encode(b"0" * 16).decode()),
        lambda home: _rewrite(home, key_source="nope"),
        lambda home: (home / "vault" / "key").write_bytes(b"short"),
    ],
    ids=["binary", "truncated", "not-object", "format", "nonce", "ciphertext", "relabelled", "source", "key-file"],
)
def test_corrupt_vault_is_unavailable(home: Path, corrupt, monkeypatch: pytest.MonkeyPatch) -> None:
    value = fresh()
    open_vault(home).set("a", value)
    corrupt(home)
    monkeypatch.setenv("KEYVEIL_PASSPHRASE", "a passphrase for the relabelled case")
    with pytest.raises(VaultUnavailable) as e:
        open_vault(home).load()
    message = str(e.value)
    assert "vault" in message
    assert str(home / "vault") in message
    assert_no_value(message, value)
    # A write must not paper over the damage either.
    with pytest.raises(VaultUnavailable):
        open_vault(home).set("b", fresh())


def test_unsupported_format_version(home: Path) -> None:
    open_vault(home).set("a", fresh())
    _rewrite(home, version=2)
    with pytest.raises(VaultUnavailable, match="version"):
        open_vault(home).load()


def test_missing_key_file(home: Path) -> None:
    open_vault(home).set("a", fresh())
    (home / "vault" / "key").unlink()
    with pytest.raises(VaultUnavailable, match="key file .* is missing"):
        open_vault(home).load()


# --- file backend: key sources ----------------------------------------------


def test_key_source_keyfile_when_nothing_else(home: Path) -> None:
    value = fresh()
    open_vault(home).set("a", value)
    assert envelope(home)["key_source"] == "keyfile"
    assert len((home / "vault" / "key").read_bytes()) == 32
    assert open_vault(home).load().current == {"a": value}


def test_key_source_passphrase_before_keyfile(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYVEIL_PASSPHRASE", "correct horse battery staple")
    value = fresh()
    open_vault(home).set("a", value)
    env = envelope(home)
    assert env["key_source"] == "passphrase"
    assert len(base64.b64decode(env["salt"])) == 16
    assert not (home / "vault" / "key").exists()
    assert open_vault(home).load().current == {"a": value}


@pytest.mark.parametrize("passphrase_set", [True, False])
def test_key_source_keyring_first(
    home: Path, fake_keyring: FileKeyring, monkeypatch: pytest.MonkeyPatch, passphrase_set: bool
) -> None:
    if passphrase_set:
        monkeypatch.setenv("KEYVEIL_PASSPHRASE", "correct horse battery staple")
    value = fresh()
    open_vault(home).set("a", value)
    assert envelope(home)["key_source"] == "keyring"
    assert "salt" not in envelope(home)
    assert not (home / "vault" / "key").exists()
    assert fake_keyring.usernames("keyveil") == [f"vault-key:{home.resolve()}"]  # the probe is gone
    assert open_vault(home).load().current == {"a": value}


@pytest.mark.parametrize("stub", [fail.Keyring, null.Keyring])
def test_stub_keyrings_are_not_used(home: Path, stub) -> None:
    keyring.set_keyring(stub())
    open_vault(home).set("a", fresh())
    assert envelope(home)["key_source"] == "keyfile"


def test_key_source_is_the_recorded_one(home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    a, b = fresh(), fresh()
    open_vault(home).set("a", a)  # created with a key file
    keyring.set_keyring(FileKeyring(tmp_path / "kr.json"))
    monkeypatch.setenv("KEYVEIL_PASSPHRASE", "correct horse battery staple")
    open_vault(home).set("b", b)
    assert envelope(home)["key_source"] == "keyfile"
    assert open_vault(home).load().current == {"a": a, "b": b}


def test_keyring_gone_makes_the_vault_unavailable(home: Path, fake_keyring: FileKeyring) -> None:
    value = fresh()
    open_vault(home).set("a", value)
    keyring.set_keyring(fail.Keyring())
    with pytest.raises(VaultUnavailable, match="OS keyring") as e:
        open_vault(home).load()
    assert_no_value(str(e.value), value)
    # An emptied keyring is the same story.
    keyring.set_keyring(FileKeyring(home.parent / "empty.json"))
    with pytest.raises(VaultUnavailable, match="OS keyring"):
        open_vault(home).load()


def test_wrong_or_missing_passphrase(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good, bad = "correct horse battery staple", "wrong horse battery staple"
    value = fresh()
    monkeypatch.setenv("KEYVEIL_PASSPHRASE", good)
    open_vault(home).set("a", value)

    monkeypatch.setenv("KEYVEIL_PASSPHRASE", bad)
    with pytest.raises(VaultUnavailable) as e:
        open_vault(home).load()
    message = str(e.value)
    assert "KEYVEIL_PASSPHRASE" in message and "passphrase the vault was created with" in message
    assert_no_value(message, value)
    assert good not in message and bad not in message
    assert e.value.__cause__ is None and e.value.__suppress_context__

    monkeypatch.delenv("KEYVEIL_PASSPHRASE")
    with pytest.raises(VaultUnavailable, match="set KEYVEIL_PASSPHRASE"):
        open_vault(home).load()

    monkeypatch.setenv("KEYVEIL_PASSPHRASE", good)
    assert open_vault(home).load().current == {"a": value}


def test_existing_key_file_is_never_overwritten(home: Path) -> None:
    vault = open_vault(home)
    vault.set("a", fresh())
    key = (home / "vault" / "key").read_bytes()
    (home / "vault" / "vault.json").unlink()
    vault.set("b", fresh())
    assert (home / "vault" / "key").read_bytes() == key


def test_existing_keyring_key_is_never_overwritten(home: Path, fake_keyring: FileKeyring) -> None:
    value = fresh()
    open_vault(home).set("a", value)
    backup = (home / "vault" / "vault.json").read_bytes()
    (home / "vault" / "vault.json").unlink()
    open_vault(home).set("b", fresh())  # a new vault under the same home
    (home / "vault" / "vault.json").write_bytes(backup)
    assert open_vault(home).load().current == {"a": value}


def test_keyring_key_is_reused_by_a_subprocess(home: Path, fake_keyring: FileKeyring) -> None:
    """The fake keyring works across processes, as the CLI and the proxy share the vault."""
    value = fresh()
    open_vault(home).set("github/pat", value)
    src = Path(keyveil.vault.__file__).resolve().parents[2]
    code = (
        "import os, sys; from pathlib import Path; from keyveil.vault import open_vault\n"
        "snap = open_vault(Path(sys.argv[1])).load()\n"
        "print(sorted(snap.current), snap.current['github/pat'] == os.environb[b'EXPECTED'])\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(src), str(Path(__file__).parent)]),
        "PYTHON_KEYRING_BACKEND": "keyring_fake.FileKeyring",
        PATH_VAR: str(fake_keyring.path),
        "EXPECTED": value.decode(),
    }
    out = subprocess.run([sys.executable, "-c", code, str(home)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['github/pat'] True"


# --- repr -------------------------------------------------------------------


def test_snapshot_repr_holds_names_not_values(home: Path, clock: Clock) -> None:
    a, b = fresh(), fresh()
    vault = open_vault(home)
    vault.set("github/pat", a)
    vault.set("github/pat", b)
    snap = vault.load()
    for text in (repr(snap), str(snap), f"{snap}", repr(vault), repr(vault.info())):
        assert_no_value(text, a, b)
    assert "github/pat" in repr(snap)
    assert repr(VaultSnapshot({"x": a}, {})) == "VaultSnapshot(current=['x'], previous={})"


# --- env backend -------------------------------------------------------------


def test_env_backend_mapping(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    a, b, c = fresh(), fresh(), fresh()
    monkeypatch.setenv("KEYVEIL_SECRET_github__pat", a.decode())
    monkeypatch.setenv("KEYVEIL_SECRET_ANTHROPIC_KEY", b.decode())
    monkeypatch.setenv("KEYVEIL_SECRET_a__b__c", c.decode())
    monkeypatch.setenv("KEYVEIL_VAULT", "env")
    vault = open_vault(home)
    assert vault.backend == "env"
    assert vault.load().current == {"github/pat": a, "ANTHROPIC_KEY": b, "a/b/c": c}
    assert [i.name for i in vault.info()] == ["ANTHROPIC_KEY", "a/b/c", "github/pat"]
    assert env_var("github/pat") == "KEYVEIL_SECRET_github__pat"
    assert not (home / "vault").exists()


def test_env_backend_is_read_only(home: Path) -> None:
    vault = open_vault(home, "env")
    with pytest.raises(UsageError, match="read-only.*KEYVEIL_SECRET_github__pat"):
        vault.set("github/pat", fresh())
    with pytest.raises(UsageError, match="read-only"):
        vault.remove("github/pat")


def test_env_backend_short_value(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    monkeypatch.setenv("KEYVEIL_SECRET_tiny", "s3cr")
    with pytest.raises(VaultUnavailable, match="KEYVEIL_SECRET_tiny") as e:
        open_vault(home, "env").load()
    assert "s3cr" not in str(e.value)


@pytest.mark.parametrize("var", ["KEYVEIL_SECRET_", "KEYVEIL_SECRET_a___b", "KEYVEIL_SECRET__x"])
def test_env_backend_bad_variable_name(var: str, monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    monkeypatch.setenv(var, fresh().decode())
    with pytest.raises(VaultUnavailable, match=var):
        open_vault(home, "env").load()


def test_env_fingerprint_follows_the_environment(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    vault = open_vault(home, "env")
    monkeypatch.setenv("KEYVEIL_SECRET_a", fresh().decode())
    first = vault.fingerprint()
    assert vault.fingerprint() == first
    monkeypatch.setenv("KEYVEIL_SECRET_a", fresh().decode())
    assert vault.fingerprint() != first


# --- keyring backend ---------------------------------------------------------


def test_keyring_backend_round_trip_and_rotation(home: Path, fake_keyring: FileKeyring, clock: Clock) -> None:
    old, new, other = fresh(), fresh(), fresh()
    vault = open_vault(home, "keyring")
    assert vault.backend == "keyring"
    assert vault.load().current == {}
    fp = vault.fingerprint()
    vault.set("github/pat", old)
    vault.set("b", other)
    clock.advance(days=1)
    vault.set("github/pat", new)
    assert vault.fingerprint() != fp

    snap = open_vault(home, "keyring").load()
    assert snap.current == {"github/pat": new, "b": other}
    assert snap.previous == {"github/pat": (old,)}
    assert [(i.name, i.versions) for i in vault.info()] == [("b", 1), ("github/pat", 2)]
    assert fake_keyring.usernames("keyveil") == ["index", "secret:b", "secret:github/pat"]
    assert not (home / "vault" / "vault.json").exists()

    clock.advance(days=31)
    vault.set("b", fresh())  # prunes github/pat's expired value from its entry
    clock.now = T0
    assert "github/pat" not in vault.load().previous
    assert_no_value((fake_keyring.path).read_bytes(), old)

    vault.remove("github/pat")
    assert fake_keyring.usernames("keyveil") == ["index", "secret:b"]
    with pytest.raises(UsageError):
        vault.remove("github/pat")


def test_keyring_backend_unavailable(home: Path) -> None:
    vault = open_vault(home, "keyring")
    with pytest.raises(VaultUnavailable, match="keyring"):
        vault.load()


# --- open_vault ----------------------------------------------------------------


def test_unknown_backend(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    with pytest.raises(UsageError, match="unknown vault backend"):
        open_vault(home, "vaultwarden")
    monkeypatch.setenv("KEYVEIL_VAULT", "nope")
    with pytest.raises(UsageError, match="KEYVEIL_VAULT"):
        open_vault(home)


def test_default_backend_is_file(home: Path) -> None:
    assert open_vault(home).backend == "file"


# --- VaultWatcher: what a running proxy sees ------------------------------------------


class FakeVault:
    """A vault whose answers the test sets; it counts the reads."""

    backend = "fake"

    def __init__(self) -> None:
        self.values = {"a": fresh()}
        self.version = 1
        self.error: Exception | None = None
        self.unavailable: dict[str, str] = {}
        self.loads = self.fingerprints = 0

    def fingerprint(self) -> str:
        self.fingerprints += 1
        if self.error:
            raise self.error
        return str(self.version)

    def load(self) -> VaultSnapshot:
        self.loads += 1
        if self.error:
            raise self.error
        return VaultSnapshot(dict(self.values), {}, dict(self.unavailable))


def test_watcher_reloads_only_when_the_fingerprint_changes() -> None:
    vault = FakeVault()
    watcher = VaultWatcher(vault, poll_seconds=1, grace_seconds=0, background=False, clock=lambda: 0.0)
    first = watcher.start()
    assert watcher.snapshot(0.5) is first and vault.fingerprints == 1  # not due yet
    assert watcher.snapshot(1.0) is first and (vault.fingerprints, vault.loads) == (2, 1)
    vault.values, vault.version = {"a": fresh()}, 2
    second = watcher.snapshot(2.0)
    assert second is not first and second.current == vault.values and vault.loads == 2


def test_watcher_local_vault_blocks_at_once_then_recovers() -> None:
    vault = FakeVault()
    watcher = VaultWatcher(vault, poll_seconds=1, grace_seconds=0, background=False, clock=lambda: 0.0)
    watcher.start()
    vault.error = VaultUnavailable("the vault /x is corrupt")
    with pytest.raises(VaultUnavailable, match="corrupt"):
        watcher.snapshot(1.0)
    with pytest.raises(VaultUnavailable):
        watcher.snapshot(1.5)  # between checks it stays blocked
    vault.error = None
    assert watcher.snapshot(2.0).current == vault.values


def test_watcher_grace_period_then_block_then_recovery() -> None:
    vault = FakeVault()
    watcher = VaultWatcher(vault, poll_seconds=2, grace_seconds=60, background=True, clock=lambda: 0.0)
    watcher.background = False  # no thread in this test: refresh() is called by hand
    good = watcher.start()
    watcher.background = True
    vault.error = VaultUnavailable("OpenBao at https://bao:8200 cannot be reached")
    for t in (2.0, 30.0, 58.0):
        watcher.refresh(t)
        assert watcher.snapshot(t) is good  # the last good values, within the grace period
    watcher.refresh(60.0)
    with pytest.raises(VaultUnavailable, match="cannot be reached"):
        watcher.snapshot(60.0)
    reads = vault.fingerprints
    with pytest.raises(VaultUnavailable):
        watcher.snapshot(61.0)
    assert vault.fingerprints == reads  # a remote vault is never read from snapshot()
    vault.error = None
    watcher.refresh(62.0)
    assert watcher.snapshot(62.0).current == vault.values


def test_watcher_fails_closed_when_its_poller_stalls() -> None:
    vault = FakeVault()
    watcher = VaultWatcher(vault, poll_seconds=2, grace_seconds=10, background=False, clock=lambda: 0.0)
    good = watcher.start()
    watcher.background = True  # as if the poll thread hung inside a read
    assert watcher.snapshot(16.0) is good
    with pytest.raises(VaultUnavailable, match="not answered for"):
        watcher.snapshot(18.0)


def test_watcher_retries_unreadable_entries_every_poll() -> None:
    vault = FakeVault()
    vault.unavailable = {"b": "permission denied reading secret/keyveil/b"}
    watcher = VaultWatcher(vault, poll_seconds=1, grace_seconds=0, background=False, clock=lambda: 0.0)
    assert watcher.start().unavailable
    watcher.snapshot(1.0)
    assert vault.loads == 2  # same fingerprint, read again for the entry that failed
    vault.unavailable = {}
    assert watcher.snapshot(2.0).unavailable == {}
    watcher.snapshot(3.0)
    assert vault.loads == 3  # all read: back to one fingerprint per poll


def test_watcher_keeps_the_snapshot_object_when_a_reload_reads_the_same_values() -> None:
    """A reload that finds nothing new must not make the proxy rebuild its engine."""
    vault = FakeVault()
    watcher = VaultWatcher(vault, poll_seconds=1, grace_seconds=0, background=False, clock=lambda: 0.0)
    first = watcher.start()
    vault.version = 2  # metadata changed, values did not
    assert watcher.snapshot(1.0) is first and vault.loads == 2
