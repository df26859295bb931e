"""Host keys and authorized keys for simcloud's SSH endpoints (no ssh-keygen needed)."""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

_KEY_TYPES = ("ssh-", "ecdsa-sha2-", "sk-ssh-", "sk-ecdsa-")


@dataclass(frozen=True)
class PublicKey:
    key_type: str  # e.g. "ssh-ed25519"
    blob_b64: str  # the base64 key blob, as in authorized_keys

    @property
    def line(self) -> str:
        return f"{self.key_type} {self.blob_b64}"


def write_ed25519_host_key(path: Path) -> str:
    """Generate an ed25519 key in OpenSSH format at `path` (mode 0600); return its public key line."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(Encoding.PEM, PrivateFormat.OpenSSH, NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return key.public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).decode()


def parse_public_keys(text: str) -> list[PublicKey]:
    """The keys in an authorized_keys-style text (one or more lines). Raises ValueError if there are none.

    Options before the key type (`from="..."`, `command=...`) are skipped; we never honour them.
    """
    keys: list[PublicKey] = []
    for raw in text.splitlines():
        tokens = raw.strip().split()
        if not tokens or tokens[0].startswith("#"):
            continue
        for i, tok in enumerate(tokens[:-1]):
            if tok.startswith(_KEY_TYPES):
                blob = tokens[i + 1]
                try:
                    base64.b64decode(blob, validate=True)
                except ValueError:
                    break
                keys.append(PublicKey(tok, blob))
                break
    if not keys:
        raise ValueError("ssh_public_key holds no OpenSSH public key line (expected 'ssh-ed25519 AAAA...')")
    return keys
