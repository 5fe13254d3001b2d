"""Headless Chromium for the page tests: the distribution's own browser (`make browser` installs
Debian's chromium package), driven by Playwright. Outside CI a machine without it skips these tests;
in CI it fails."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

# As the machine's probe starts it: no GPU, no network of its own (it would try Google's hosts and
# be refused)
ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("no chromium: `make browser` installs it (CI must run the page tests)")
        pytest.skip("no chromium (make browser)")
    return found


@contextmanager
def browser(offline: bool = False, width: int = 1500, height: int = 1400) -> Iterator:
    """A page of a fresh headless Chromium (offline: no network at all), closed after the block."""
    from playwright.sync_api import sync_playwright

    path = chromium_path()
    with sync_playwright() as p:
        chrome = p.chromium.launch(executable_path=path, args=ARGS)
        try:
            context = chrome.new_context(
                offline=offline, viewport={"width": width, "height": height}
            )
            yield context.new_page()
        finally:
            chrome.close()
