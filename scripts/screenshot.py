"""A picture of one of Orbit's pages, for the docs: `panels.html` (a file), or the live page of a
run or a sweep (a directory: served by `orbit watch` on a free port for the time of the picture,
then stopped).

    python scripts/screenshot.py bench/figures/panels.html docs/images/panels.png
    python scripts/screenshot.py runs/smollm2-math docs/images/live-run.png

Drives the machine's Chromium (`make browser`) through Playwright, as the page tests do."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orbit.host.net import free_port  # noqa: E402
from tests.browser import ARGS  # noqa: E402

SETTLE_S = 4.0  # the page's first refresh and Plotly's drawing


def served(directory: Path, port: int) -> subprocess.Popen:
    """`orbit watch` on `directory`, answering on `port` (bounded wait; its output says why if
    not)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "watch", str(directory), "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"orbit watch exited: {proc.stdout.read()}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1.0)
            return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"orbit watch did not answer on port {port} within 60 s")


def shoot(url: str, out: Path, width: int, height: int) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium: make browser")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(url)
            time.sleep(SETTLE_S)
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="an HTML file, or a run or sweep directory")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1000)
    args = parser.parse_args()
    if args.source.is_file():
        shoot(args.source.resolve().as_uri(), args.out, args.width, args.height)
    else:
        port = free_port()
        proc = served(args.source, port)
        try:
            shoot(f"http://127.0.0.1:{port}/", args.out, args.width, args.height)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(args.out)


if __name__ == "__main__":
    main()
