"""Ports on this machine: what Orbit's servers (the SGLang servers it starts, the episode endpoint, the
live page) and the trainer ranks' rendezvous listen on."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the OS picks it; a race with another process is possible but rare)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
