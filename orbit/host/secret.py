"""Secrets that must not reach a log, an error message or a run directory (an SGLang server's API
key)."""

from __future__ import annotations


def scrub(text: str, secret: str | None) -> str:
    """`text` with every occurrence of `secret` masked."""
    return text.replace(secret, "***") if secret else text
