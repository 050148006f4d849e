"""KEYVEIL_HOME: where rules, CA, vault and audit log live (SPEC §9).

``Home`` names the paths and creates what is missing with private modes.
It never overwrites an existing rules file.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path


def default_home() -> Path:
    return Path(os.environ.get("KEYVEIL_HOME") or Path.home() / ".keyveil").expanduser()


@functools.lru_cache(maxsize=8)
def _generation_path(root: Path) -> str:
    # A running proxy stats it twice per flow: the path is joined once per home.
    return os.fspath(root / "vault-generation")


@dataclass(frozen=True)
class Home:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config"

    @property
    def rules(self) -> Path:
        return self.config / "rules.yaml"

    @property
    def certs(self) -> Path:
        return self.root / "certs"

    @property
    def ca_cert(self) -> Path:
        return self.certs / "mitmproxy-ca-cert.pem"

    @property
    def ca_bundle(self) -> Path:
        """System CAs plus keyveil's CA, for the variables that replace the default bundle."""
        return self.certs / "keyveil-bundle.pem"

    @property
    def vault(self) -> Path:
        return self.root / "vault"

    @property
    def audit(self) -> Path:
        return self.root / "audit"

    @property
    def generation(self) -> Path:
        """Bumped by every `keyveil secret` command that changed the vault; holds no value.

        Beside the vault folder, not in it: a remote vault writes nothing there."""
        return Path(_generation_path(self.root))

    def bump_generation(self) -> None:
        """Tell a running proxy the vault changed: a new file (a new inode) every time."""
        tmp = self.generation.with_name(f".vault-generation.{os.getpid()}.tmp")
        tmp.write_text(f"{time.time_ns()}\n")
        os.replace(tmp, self.generation)

    def generation_stamp(self) -> tuple | None:
        try:
            st = os.stat(_generation_path(self.root))
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def ensure(self) -> bool:
        """Create missing folders and the rules file. True when the rules file was created."""
        for path, mode in ((self.root, 0o700), (self.config, 0o700), (self.certs, 0o700), (self.vault, 0o700), (self.audit, 0o700)):
            path.mkdir(parents=True, exist_ok=True, mode=mode)
        if self.rules.exists():
            return False
        from ._rules import shipped_config_dir

        example = shipped_config_dir() / "rules.example.yaml"
        tmp = self.rules.with_suffix(".tmp")
        shutil.copyfile(example, tmp)
        os.chmod(tmp, 0o600)
        try:
            os.link(tmp, self.rules)  # fails if a rules file appeared meanwhile: never overwrite
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        return True
