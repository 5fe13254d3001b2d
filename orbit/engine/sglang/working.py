"""Whether an SGLang server is alive: its /health, and for a server Orbit started the CPU time its
processes spend, which tells a slow server from a hung one. A scheduler in a long batch answers
nothing (not even /health, a one-token generate queued behind the batch) but spends a core's worth
of CPU; a stopped (SIGSTOP) or deadlocked one spends none."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable

import httpx
import psutil

WORKING_SHARE = 0.1  # CPU seconds per wall second: a working scheduler spends ~1.0, a stopped 0
WORK_WINDOW_S = 2.0  # the share is taken over the last this many seconds
# SGLang's own --watchdog-timeout: no batch takes longer, so a server busy without an answer for
# longer is spinning (a collective or a sync waiting on a hung device), not working
MAX_BUSY_S = 300.0


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
        """Sample now; the share over the last `window_s` (None until watched that long). A child
        that exited takes its time along: never below 0."""
        now, spent = time.monotonic(), self._spent()
        self._samples.append((now, spent))
        # keep one sample at least window_s old, none older
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        t0, s0 = self._samples[0]
        return None if now - t0 < self.window_s else max(0.0, spent - s0) / (now - t0)


class HealthWatch:
    """One /health request at a time, looked at (never awaited) each time `check` runs: a server
    whose /health goes unanswered for `timeout_s` is hung, unless Orbit started it (`pid`) and its
    processes are at work, for up to MAX_BUSY_S."""

    def __init__(
        self, ask: Callable[[], Awaitable[httpx.Response]], pid: int | None, timeout_s: float
    ) -> None:
        self._ask = ask
        self.timeout_s = timeout_s
        self._clock = CpuClock(pid, WORK_WINDOW_S) if pid else None
        self._asked: asyncio.Future[httpx.Response] | None = None
        self._since: float | None = None  # when /health last went unanswered

    async def check(self) -> str | None:
        """None while alive; why it is not."""
        share = self._clock.share() if self._clock is not None else None
        # a started server not yet watched for a window is given it
        working = self._clock is not None and (share is None or share >= WORKING_SHARE)
        now = time.monotonic()
        if self._since is None:
            self._since = now
        if self._asked is None:
            self._asked = asyncio.ensure_future(self._ask())
            # a request that fails after the watch stopped looking (the server killed) is not news
            self._asked.add_done_callback(lambda t: t.cancelled() or t.exception())
        if self._asked.done():
            asked, self._asked = self._asked, None
            try:
                res = asked.result()
            except httpx.TransportError as e:
                return f"cannot be reached ({type(e).__name__}: {e})"
            if res.status_code == 200:
                self._since = None
                return None
            # SGLang's /health gives up (503) after 20 s without output: a batch that long
            if not (res.status_code == 503 and working):
                return f"/health answered HTTP {res.status_code}"
        waited = now - self._since
        if waited < self.timeout_s or (working and waited < MAX_BUSY_S):
            return None  # answering, or slow: at work
        self.close()
        if working:
            return (
                f"did not answer /health for {waited:.0f} s though at work: longer than any "
                "batch (hung)"
            )
        spent = "" if share is None else f" and its processes spent {share:.0%} of a core"
        return f"did not answer /health for {waited:.1f} s{spent} (hung)"

    def close(self) -> None:
        if self._asked is not None:
            self._asked.cancel()
            self._asked = None
