"""The slot gate: which adapter each slot holds, which requests use it, and when it may be
rewritten.

Slot i is the SGLang adapter name `orbit-slot-i`. SGLang binds a request to the adapter instance it
was admitted with, and `unload_lora_adapter` waits until every request using that name has finished,
so a slot is rewritten only once the requests on it are gone: the rewrite holds new requests for the
slot, waits for the running ones to finish (on the adapter they started with), unloads, loads, and
lets the held ones in. Each load gets a fresh adapter instance, and SGLang's radix cache is keyed
by it: KV computed under an older adapter is never served again.

Unloading while generation is paused would wait for the paused requests forever (a known deadlock
in other RL stacks): a rewrite of a loaded slot is refused at once while paused.

All of it lives on the engine's event loop (one thread): no locks, only asyncio events.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from orbit.engine.base import EngineDeadError, EngineError

Outcome = tuple[bool, str]  # (success, SGLang's message)


def slot_name(slot: int) -> str:
    """The SGLang adapter name of a slot: every request on the slot carries it as `lora_path`."""
    return f"orbit-slot-{slot}"


class SlotGate:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.version: list[int | None] = [None] * slots  # the version each slot holds; None: empty
        self.users = [0] * slots  # requests admitted on each slot and not finished
        self.held = [0] * slots  # requests waiting for their slot's rewrite to end
        self._ready = [asyncio.Event() for _ in range(slots)]  # cleared while a slot is rewritten
        self._idle = [asyncio.Event() for _ in range(slots)]
        self._rewriting = [asyncio.Lock() for _ in range(slots)]  # one rewrite per slot at a time
        # what to load back if SGLang refuses a load
        self._backup: list[tuple | None] = [None] * slots
        for e in (*self._ready, *self._idle):
            e.set()

    def requests(self) -> tuple[int, ...]:
        """Per slot: requests bound to it, running or held."""
        return tuple(u + h for u, h in zip(self.users, self.held, strict=True))

    async def enter(self, slot: int) -> int:
        """A request starts on `slot`: wait out a rewrite; returns the version it runs with."""
        while not self._ready[slot].is_set():
            self.held[slot] += 1
            try:
                await self._ready[slot].wait()
            finally:
                self.held[slot] -= 1
        version = self.version[slot]
        if version is None:
            raise EngineError(f"slot {slot} is empty: its last load failed")
        self.users[slot] += 1
        self._idle[slot].clear()
        return version

    def leave(self, slot: int) -> None:
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self._idle[slot].set()

    async def rewrite(
        self,
        slot: int,
        version: int,
        paused: bool,
        load: Callable[[], Awaitable[Outcome]],
        unload: Callable[[], Awaitable[Outcome]],
        restore: Callable[[tuple], Awaitable[Outcome]],
        backup: tuple,
    ) -> float:
        """Replace the slot's adapter with the one `load()` loads. Returns the write time (when the
        slot's last request had finished). A load SGLang refuses puts `restore(previous backup)`
        back; EngineError says what happened and what the slot serves now."""
        name = slot_name(slot)
        async with self._rewriting[slot]:
            previous = self.version[slot]
            if previous is not None and paused:
                raise EngineError(
                    f"load_adapter({slot}) while paused: replacing the adapter means unloading "
                    f"'{name}', which waits for the requests using it, and paused requests never "
                    "finish. Load while generation runs (the requests on the slot finish first) or "
                    "pause with 'abort'"
                )
            ready = self._ready[slot]
            # new requests for this slot wait for the new adapter (they count as held)
            ready.clear()
            try:
                # requests on the slot finish on the adapter they started with
                while self.users[slot]:
                    await self._idle[slot].wait()
                written = time.time()
                if previous is not None:
                    ok, message = await unload()
                    if not ok:
                        raise EngineError(f"SGLang could not unload {name!r}: {message}")
                try:
                    ok, message = await load()
                except EngineDeadError:
                    raise  # not a refusal: SGLang is gone
                except Exception as e:  # noqa: BLE001 - treated like SGLang's own refusal
                    ok, message = False, f"{type(e).__name__}: {e}"
                if not ok:
                    note = f" (slot {slot} is now empty)"
                    kept = self._backup[slot]
                    if previous is not None and kept is not None and (await restore(kept))[0]:
                        note = f" (slot {slot} keeps serving version {previous})"
                    else:
                        self.version[slot], self._backup[slot] = None, None
                    raise EngineError(
                        f"SGLang refused the adapter for slot {slot}: {message}{note}"
                    )
                self._backup[slot] = backup
                self.version[slot] = version
                return written
            finally:
                ready.set()
