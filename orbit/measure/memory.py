"""A process's peak resident memory over a stretch of work, sampled (the benches' "peak memory")."""

from __future__ import annotations

import threading

import psutil


class PeakRss:
    """This process's resident memory sampled every `every_s` seconds while inside: its `peak`
    (bytes)."""

    def __init__(self, every_s: float = 0.05) -> None:
        self.peak = 0
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="orbit-peak-rss", daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        process = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, process.memory_info().rss)
            self._stop.wait(self.every_s)
