"""Asking engines that may be dead or hung: a bounded call, a call whose error is a value, and a
call whose error does not matter (stopping something already gone)."""

from __future__ import annotations

import threading


def bounded(call, seconds: float):
    """`call()`'s result, or the exception it raised, or TimeoutError after `seconds` (the call is
    left running in a daemon thread: for asking a possibly hung engine, never for control)."""
    box: list = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as err:  # noqa: BLE001 - handed back as a value
            box.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return box[0] if box else TimeoutError(f"no answer within {seconds:g} s")


def outcome(call, member):
    try:
        return call(member), None
    except BaseException as err:  # noqa: BLE001 - sorted out by the caller
        return None, err


def quietly(call) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - stopping something already gone
        pass
