"""API keys and tenants. `orbit serve --keys FILE` reads one key a line (blank lines and lines
starting with # are skipped); each key is a tenant, known in the database and the pages only by a
digest of it, so that no key is written anywhere. The SDK sends its key as `X-API-Key` and insists
that it starts with `tml-` or is a JWT: a file's keys are checked for that when it is read.

Without a keys file the service is one tenant, `local`, and takes any key: for a laptop, where it
listens on 127.0.0.1 only (a non-loopback `--host` needs keys).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path

LOCAL = "local"  # the one tenant of a service without keys


class KeysError(ValueError):
    """A keys file Orbit cannot use; the message names the file and the line."""


def tenant_of(key: str) -> str:
    """A tenant's name: the first 16 hex digits of the key's SHA-256 (the key itself is never
    kept)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Keys:
    """The digests of the keys a service takes; empty: no keys (one tenant, any key)."""

    digests: frozenset[str] = field(default_factory=frozenset)

    @property
    def required(self) -> bool:
        return bool(self.digests)

    def tenant(self, key: str | None) -> str | None:
        """The key's tenant, or None when it is missing or not one of these keys."""
        if not self.required:
            return LOCAL
        if not key:
            return None
        digest = hashlib.sha256(key.encode()).hexdigest()
        # compare every digest, each in constant time: no timing says how near a guess came
        found = [hmac.compare_digest(digest, d) for d in self.digests]
        return tenant_of(key) if any(found) else None


def read_keys(path: Path) -> Keys:
    """The keys in `path`, one a line; KeysError naming the line of one the SDK could not send."""
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise KeysError(f"--keys {path}: {err.strerror}") from None
    digests = set()
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if not (key.startswith("tml-") or key.count(".") == 2) or any(c.isspace() for c in key):
            raise KeysError(
                f"--keys {path}, line {number}: not a key the tinker SDK sends (one that starts "
                "with tml- or a JWT, without spaces)"
            )
        digests.add(hashlib.sha256(key.encode()).hexdigest())
    if not digests:
        raise KeysError(f"--keys {path}: no keys in the file")
    return Keys(frozenset(digests))
