"""Math answers checked with math-verify (the checker TRL, AReaL, PipelineRL and tinker-cookbook
use), each check bounded in time.

The answer a completion gives is its last `\\boxed{}`, else what follows its last `####`, else its
final number (`answer_text`); math-verify parses it and compares it with the gold answer by value
(`42`, `42.0`, `1,234`, `3/4`, `0.75`). A final *expression* is not an answer: "so 38 + 57 = "
restates the question, and math-verify would evaluate it to the right value.
Its own time limits use SIGALRM, which works only in a process's main thread, while Orbit scores in
the producer's thread. So the checks run in a small process of Orbit's own, on its main thread, with
math-verify's limits on; and a check that does not come back within `timeout_s` (a pathological
completion that sends sympy into a long simplification) is cut by killing that process, which is
started again for the next check. The check counts as wrong, with `timed_out` set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from multiprocessing.connection import Connection

from orbit.tasks.worker import Worker, serve_requests

# A number as a completion writes it: sign, digits with thousands commas, decimals, a fraction.
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def answer_text(text: str) -> str | None:
    """What a completion gives as its answer: its last `\\boxed{...}` (the whole LaTeX, for
    math-verify to read the boxed one), else what follows its last `####`, else its final number;
    None when it gives none."""
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
    """Thread-safe; one check at a time through one worker process (worker.py), started on first
    use."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self._worker = Worker(_serve, (timeout_s,), "orbit-math-verify", timeout_s)

    def unreadable(self, golds: list[str]) -> list[int]:
        """The indices of gold answers math-verify cannot read a value from (one round trip for
        all)."""
        kind, value = self._worker.ask(
            ("golds", golds, ""), timeout_s=max(self.timeout_s, 0.05 * len(golds))
        )
        if kind != "ok":
            why = "within its time limit" if kind == "timeout" else f"({value})"
            raise RuntimeError(f"math-verify did not read {len(golds)} gold answers {why}")
        return list(value)

    def check(self, completion: str, gold: str) -> Verdict:
        given = answer_text(completion)
        if given is None:
            return Verdict(False, None)
        kind, value = self._worker.ask(("check", given, gold))
        # it ran out of time, or its process died on this completion: not a correct one
        if kind != "ok":
            return Verdict(False, None, timed_out=True)
        correct, given = value
        return Verdict(bool(correct), given)

    def close(self) -> None:
        self._worker.close()


def _serve(conn: Connection, timeout_s: float) -> None:
    """The worker: math-verify on its main thread, with its own time limits (whole seconds)."""
    import logging

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # its timeouts are answers here, not news
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    seconds = max(1, int(timeout_s) - 1)
    gold_config = [ExprExtractionConfig(), LatexExtractionConfig()]
    # \boxed{} first
    given_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]

    def readable(gold: str) -> bool:
        """A value: a number or an expression (digits, LaTeX), not a word read as a product of
        symbols."""
        try:
            parsed = parse(gold, extraction_config=gold_config, parsing_timeout=seconds)
        except Exception:  # noqa: BLE001 - unreadable is the answer
            return False
        symbols = getattr(parsed[0], "free_symbols", ()) if parsed else ()
        return bool(parsed) and (not symbols or re.search(r"[\d\\]", gold) is not None)

    def answer(request: tuple) -> tuple:
        kind, text, gold = request
        try:
            if kind == "golds":
                return "ok", [i for i, g in enumerate(text) if not readable(g)]
            target = parse(gold, extraction_config=gold_config, parsing_timeout=seconds)
            given = parse(text, extraction_config=given_config, parsing_timeout=seconds)
            correct = bool(given) and verify(target, given, timeout_seconds=seconds)
            return "ok", (correct, str(given[-1])[:200] if given else None)
        # a completion math-verify cannot handle is not a correct one
        except Exception:  # noqa: BLE001
            return "ok", (False, None)

    serve_requests(conn, answer)
