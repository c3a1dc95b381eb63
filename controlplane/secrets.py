"""Credentials: random keys and agent tokens, stored only as hashes and checked in constant time.

A credential reads `<prefix>_<id>_<secret>`: the id finds the row, the secret (256 random bits)
is compared by its SHA-256 digest with `hmac.compare_digest`. A fast hash is right here because
the secret is random, not a password: there is nothing to brute-force.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

API_KEY_PREFIX = "spk"
AGENT_TOKEN_PREFIX = "spa"  # noqa: S105 - a prefix, not a secret


@dataclass(frozen=True)
class Credential:
    """A parsed bearer credential: which kind, which row, and the secret to check."""

    prefix: str
    ident: str
    secret: str


def new_ident() -> str:
    return secrets.token_hex(8)


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def format_credential(prefix: str, ident: str, secret: str) -> str:
    return f"{prefix}_{ident}_{secret}"


def parse_credential(raw: str) -> Credential | None:
    parts = raw.split("_", 2)
    if len(parts) != 3 or parts[0] not in (API_KEY_PREFIX, AGENT_TOKEN_PREFIX):
        return None
    prefix, ident, secret = parts
    if len(ident) != 16 or not secret:
        return None
    return Credential(prefix, ident, secret)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)
