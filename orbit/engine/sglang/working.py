"""Whether SGLang's processes are at work, from the CPU time they spend: what tells a slow server
from a hung one. A scheduler in a long prefill answers nothing (not even /health, a one-token
generate queued behind the batch) but spends a core's worth of CPU; a stopped (SIGSTOP) or
deadlocked one spends none."""

from __future__ import annotations

import time
from collections import deque

import psutil

WORKING_SHARE = 0.1  # CPU seconds per wall second: a working scheduler spends ~1.0, a stopped 0


class CpuClock:
    """CPU seconds a process and its children spent per wall second over the last `window_s`."""

    def __init__(self, pid: int, window_s: float) -> None:
        self.pid = pid
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def _spent(self) -> float:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for proc in procs:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass  # gone between the listing and the look
        return total

    def share(self) -> float | None:
        """Sample now; the share over the last `window_s` (None until watched that long)."""
        now, spent = time.monotonic(), self._spent()
        self._samples.append((now, spent))
        # keep one sample at least window_s old, none older
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        t0, s0 = self._samples[0]
        return None if now - t0 < self.window_s else (spent - s0) / (now - t0)
