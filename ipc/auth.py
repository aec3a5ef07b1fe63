"""Shared-secret challenge/response: a peer proves it holds the secret without sending it.

hello{nonce_c} -> challenge{nonce_s} -> auth{mac = HMAC-SHA256(secret, nonce_s | nonce_c | role)}.
Only an identity that completed this exchange may send anything else to a shard.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

SECRET_ENV = "LAYERSPLIT_SECRET"


def new_secret() -> bytes:
    return os.urandom(32)


def new_nonce() -> bytes:
    return os.urandom(16)


def mac(secret: bytes, server_nonce: bytes, client_nonce: bytes, role: str) -> bytes:
    return hmac.new(secret, server_nonce + client_nonce + role.encode(), hashlib.sha256).digest()


def verify(secret: bytes, server_nonce: bytes, client_nonce: bytes, role: str, got: bytes) -> bool:
    return hmac.compare_digest(mac(secret, server_nonce, client_nonce, role), got)


def load_secret(secret_file: str | None = None) -> bytes | None:
    """The shared secret from a file (first line, hex or text) or $LAYERSPLIT_SECRET."""
    text = None
    if secret_file:
        p = Path(secret_file)
        if p.stat().st_mode & 0o077:
            raise PermissionError(f"{p}: secret file must not be readable by others (chmod 600)")
        text = p.read_text().strip()
    elif os.environ.get(SECRET_ENV):
        text = os.environ[SECRET_ENV].strip()
    if not text:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return text.encode()
