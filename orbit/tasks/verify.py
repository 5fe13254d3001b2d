"""Math answers checked with math-verify (the checker TRL, AReaL, PipelineRL and tinker-cookbook use), each
check bounded in time.

The answer a completion gives is its last `\\boxed{}`, else what follows its last `####`, else its final
number (`answer_text`); math-verify parses it and compares it with the gold answer by value (`42`,
`42.0`, `1,234`, `3/4`, `0.75`). A final *expression* is not an answer: "so 38 + 57 = " restates the
question, and math-verify would evaluate it to the right value.
Its own time limits use SIGALRM, which works only in a process's main thread, while Orbit scores in
the producer's thread. So the checks run in a small process of Orbit's own, on its main thread, with
math-verify's limits on; and a check that does not come back within `timeout_s` (a pathological
completion that sends sympy into a long simplification) is cut by killing that process, which is
started again for the next check. The check counts as wrong, with `timed_out` set.
"""

from __future__ import annotations

import multiprocessing as mp
import re
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

_PARENT_POLL_S = 1.0
START_TIMEOUT_S = 120.0  # importing sympy on a loaded 2-core machine


# A number as a completion writes it: sign, digits with thousands commas, decimals, a fraction.
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def answer_text(text: str) -> str | None:
    """What a completion gives as its answer: its last `\\boxed{...}` (the whole LaTeX, for math-verify to
    read the boxed one), else what follows its last `####`, else its final number; None when it gives none."""
    if "\\boxed" in text:
        return text
    if "####" in text:
        return text.rsplit("####", 1)[1].strip() or None
    numbers = NUMBER.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


@dataclass(frozen=True)
class Verdict:
    correct: bool
    given: str | None  # the answer math-verify read from the completion (None: none found)
    timed_out: bool = False


class MathChecker:
    """Thread-safe; one check at a time through one worker process, started on first use."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def unreadable(self, golds: list[str]) -> list[int]:
        """The indices of gold answers math-verify cannot read a value from (one round trip for all)."""
        kind, value = self._ask(("golds", golds, ""), timeout_s=max(self.timeout_s, 0.05 * len(golds)))
        if kind != "ok":
            raise RuntimeError(f"math-verify did not read {len(golds)} gold answers within its time limit")
        return list(value)

    def check(self, completion: str, gold: str) -> Verdict:
        given = answer_text(completion)
        if given is None:
            return Verdict(False, None)
        kind, value = self._ask(("check", given, gold))
        if kind == "timeout":
            return Verdict(False, None, timed_out=True)
        correct, given = value
        return Verdict(bool(correct), given)

    def _ask(self, request: tuple, timeout_s: float | None = None) -> tuple[str, object]:
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send(request)
            if self._conn.poll(timeout_s or self.timeout_s):
                try:
                    return self._conn.recv()
                except EOFError:
                    pass
            self._stop()  # stuck (or dead): the next check gets a fresh process
            return "timeout", None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.timeout_s), name="orbit-math-verify", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        try:
            ready = parent.poll(START_TIMEOUT_S) and parent.recv() == "ready"
        except EOFError:
            ready = False
        if not ready:
            code = self._proc.exitcode
            self._stop()
            raise RuntimeError(f"the math-verify process did not start (exit code {code})")

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        with self._lock:
            self._stop()


def _serve(conn: Connection, timeout_s: float) -> None:
    """The worker: math-verify on its main thread, with its own time limits (whole seconds)."""
    import logging
    import signal
    from multiprocessing import parent_process

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # its timeouts are answers here, not news
    seconds = max(1, int(timeout_s) - 1)
    gold_config = [ExprExtractionConfig(), LatexExtractionConfig()]
    given_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]  # \boxed{} first
    def readable(gold: str) -> bool:
        """A value: a number or an expression (digits, LaTeX), not a word read as a product of symbols."""
        try:
            parsed = parse(gold, extraction_config=gold_config, parsing_timeout=seconds)
        except Exception:  # noqa: BLE001 - unreadable is the answer
            return False
        symbols = getattr(parsed[0], "free_symbols", ()) if parsed else ()
        return bool(parsed) and (not symbols or re.search(r"[\d\\]", gold) is not None)

    conn.send("ready")
    parent = parent_process()
    while True:
        if not conn.poll(_PARENT_POLL_S):
            if parent is not None and not parent.is_alive():
                return
            continue
        try:
            kind, text, gold = conn.recv()
        except EOFError:
            return
        try:
            if kind == "golds":
                conn.send(("ok", [i for i, g in enumerate(text) if not readable(g)]))
            else:
                target = parse(gold, extraction_config=gold_config, parsing_timeout=seconds)
                given = parse(text, extraction_config=given_config, parsing_timeout=seconds)
                correct = bool(given) and verify(target, given, timeout_seconds=seconds)
                conn.send(("ok", (correct, str(given[-1])[:200] if given else None)))
        except Exception:  # noqa: BLE001 - a completion math-verify cannot handle is not a correct one
            conn.send(("ok", (False, None)))
