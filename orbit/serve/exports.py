"""External weights: a training client's adapter exported for download (`save_weights_external`),
`tinker://{client}/external_weights/{name}`, and the signed links RestClient's
`get_external_weights_urls` hands out for its files.

An export is peft's adapter files, each encrypted with age to the request's recipients (native
`age1...` keys or SSH public keys; a file `f` is stored as `f.age`) when it names any, as Tinker
does: the cookbook's `weights.download` exports a training checkpoint to a key it generates, fetches
the files and decrypts them. A link is the checkpoint and file signed with the service's own secret
(itsdangerous) and good for LINK_S: whoever holds it fetches the file without an API key, as with a
cloud store's signed URL, and only while the checkpoint lasts.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyrage
from itsdangerous import BadSignature, SignatureExpired, URLSafeTimedSerializer

from orbit.serve.futures import NotFound, Refused

AGE = ".age"
MAX_RECIPIENTS = 10  # the SDK's bound
LINK_S = 3600  # how long a download link holds (the SDK signs again when one is about to expire)
ROUTE = "/api/v1/external_weights_files/"  # + a link's token: answered without a key


def recipients(keys: list[str] | None) -> list[object]:
    """The age recipients a request names, parsed; Refused naming the first that is not one."""
    if len(keys or []) > MAX_RECIPIENTS:
        raise Refused(f"age_encryption_recipients: {len(keys or [])}; at most {MAX_RECIPIENTS}")
    out: list[object] = []
    for key in keys or []:
        kind = pyrage.ssh if key.startswith(("ssh-", "ecdsa-")) else pyrage.x25519
        try:
            out.append(kind.Recipient.from_str(key))
        except Exception:  # noqa: BLE001 - pyrage's parse errors carry no type of their own
            raise Refused(
                f"age_encryption_recipients: {key[:40]!r} is not an age recipient (age1...) or an "
                "SSH public key"
            ) from None
    return out


def encrypt(directory: Path, to: list[object]) -> None:
    """Every file of `directory` encrypted to `to` as `name.age`, the plain file removed."""
    for plain in sorted(p for p in directory.iterdir() if p.is_file()):
        pyrage.encrypt_file(str(plain), str(plain) + AGE, to)
        plain.unlink()


@dataclass(frozen=True)
class Link:
    tenant: str
    path: str  # the export's tinker:// path
    file: str  # a file of it, relative to its directory


class Links:
    """Signed download links, with a secret kept in `secret_file` (made once, 0600): a link handed
    out before a restart still opens after it."""

    def __init__(self, secret_file: Path) -> None:
        if not secret_file.is_file():
            _write_private(secret_file, secrets.token_urlsafe(32))
        secret = secret_file.read_text().strip()
        if len(secret) < 32:  # never sign with a guessable key
            raise RuntimeError(
                f"{secret_file}: not a secret this service wrote; remove it to make one"
            )
        self._signer = URLSafeTimedSerializer(secret, salt="export")

    def urls(self, base_url: str, link: list[Link]) -> tuple[dict[str, str], float]:
        """A URL for each file, and when they stop opening (time.time)."""
        out = {
            x.file: base_url.rstrip("/")
            + ROUTE
            + str(self._signer.dumps([x.tenant, x.path, x.file]))
            for x in link
        }
        return out, time.time() + LINK_S

    def open(self, token: str) -> Link:
        """What a link's token names; NotFound for one not signed here or past its time."""
        try:
            tenant, path, file = self._signer.loads(token, max_age=LINK_S)
        except SignatureExpired:
            raise NotFound(f"this download link expired ({LINK_S} s after it was signed)") from None
        except BadSignature:
            raise NotFound("not a download link this service signed") from None
        return Link(str(tenant), str(path), str(file))


def _write_private(path: Path, text: str) -> None:
    """`text` into a new file only its owner reads, whole or not at all: written beside it, then
    linked in place (a start beside another keeps the first one's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".secret-")  # 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.link(temp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(temp)
