"""N engines as one (docs/design.md §8): routing, failover and fan-out. The producer and the loop
see one pool whether it holds one engine or eight; what each member serves is set by the push
(orbit/push/), which calls `serves`.

- Routing: a request goes to the live member with the least outstanding work (requests in flight
  over its `max_running`), or to the member the caller names (a multi-turn episode stays on its
  engine, whose prefix cache holds its context). `pick(min_version)` says which member a new group
  may start on (admission, §5).
- Faults: a member whose requests fail with EngineDeadError, or that neither answers a ping nor
  makes progress (its heartbeat: liveness.py) for `ping_timeout_s`, leaves the pool at once
  (`drop`): a warning, a timeline event, its engine killed (only its own processes), and its
  outstanding requests resubmitted to the others.
- Comebacks: with a reviver (orbit/run/revive.py) a member that left is `reviving` until the reviver
  calls `rejoin` (a new engine in its place, serving a given version) or `gave_up`. While no member
  is alive but one may come back, requests are held and fan-out calls wait; only when none is
  alive and none is coming back do requests and calls fail (EngineDeadError naming every end).
- Fan-out: `each(call)` runs a call on every live member in parallel; `stats`, `release_memory` and
  `resume_memory` are the pool-wide calls the loop makes.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from orbit.engine.base import (
    ACTIVE,
    Capabilities,
    Completion,
    Engine,
    EngineDeadError,
    EngineInfo,
    EngineStats,
    SamplingParams,
    Slot,
    resolve,
    summed,
)
from orbit.engine.calls import bounded, outcome, quietly
from orbit.engine.liveness import Liveness
from orbit.engine.member import Member, Request
from orbit.host.threads import helper_thread

PING_S = 1.0  # liveness check of every member this often


class EnginePool:
    """`engines` (one or more, all of one backend) as one."""

    def __init__(
        self,
        engines: list[Engine],
        capacities: list[int],
        timeline=None,
        ping_timeout_s: float = 5.0,
        monitor: bool = True,
        on_warning: Callable[[str], None] | None = None,
    ) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        if any(e.capabilities != engines[0].capabilities for e in engines):
            raise ValueError(
                "the engines of a pool must have the same capabilities, got "
                f"{[e.capabilities for e in engines]}"
            )
        self.members = [
            Member(i, e, max(1, c))
            for i, (e, c) in enumerate(zip(engines, capacities, strict=True))
        ]
        self.capabilities: Capabilities = engines[0].capabilities
        # the model's facts: one model, the same on every member
        self.info: EngineInfo = engines[0].info
        self.timeline = timeline
        self.ping_timeout_s = ping_timeout_s
        self.on_warning = on_warning or (lambda message: None)
        self._listeners: list[Callable[[], None]] = []
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # a member left, came back or was given up
        self._reviver: Callable[[Member], None] | None = None
        self._parked: list[Request] = []  # held while no member is alive but one is coming back
        self.rejoined = 0  # members that came back (a metric)
        self.empty_since = 0.0  # time.monotonic() when the last live member left
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._closed = False
        self._reapers: list[threading.Thread] = []  # stopping the engines that left the pool
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="orbit-pool-monitor", daemon=True)
        if monitor:
            self._monitor.start()

    # ---- what callers read ---------------------------------------------------------------------

    def alive(self) -> list[Member]:
        with self._lock:
            return [m for m in self.members if m.alive]

    def versions(self) -> list[int | None]:
        """Per member: the version it serves, None once it has left the pool."""
        with self._lock:
            return [m.version if m.alive else None for m in self.members]

    def transports(self) -> list[str]:
        """Per member: how adapters reach it (reported in the metrics)."""
        return [m.engine.adapter_transport for m in self.members]

    def revive_with(self, reviver: Callable[[Member], None]) -> None:
        """`reviver(member)` is called for every member that leaves; it later calls `rejoin` or
        `gave_up` for it."""
        self._reviver = reviver

    def listen(self, callback: Callable[[], None]) -> None:
        """`callback()` after any member's version or liveness changes (admission may open)."""
        self._listeners.append(callback)

    def pick(self, min_version: int | None = None) -> int | None:
        """The live member with the least outstanding work that serves at least `min_version`."""
        with self._lock:
            fresh = [
                m
                for m in self.members
                if m.alive and (min_version is None or m.version >= min_version)
            ]
            if not fresh:
                return None
            return min(fresh, key=lambda m: (m.outstanding / m.capacity, m.index)).index

    def serves(self, member: Member, version: int) -> None:
        """`member` now serves `version` (its push or flip completed)."""
        with self._lock:
            member.version = max(member.version, version)
        self._notify()

    # ---- requests ------------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        slot: Slot = ACTIVE,
        meta: dict | None = None,
        engine: int | None = None,
    ) -> Future[Completion]:
        """Submit to member `engine` (if alive) or to the least-loaded one. Bad input raises here,
        as the member engine would; the future's Completion carries the member's index as
        `engine`."""
        req = Request(list(prompt_ids), sampling, slot, meta, Future(), rid=next(self._ids))
        self._dispatch(req, engine, raise_errors=True)
        return req.future

    def _dispatch(self, req: Request, engine: int | None, raise_errors: bool = False) -> None:
        with self._lock:
            target = engine if engine is not None and self.members[engine].alive else self.pick()
            if target is None:
                if self._hope():
                    self._parked.append(req)  # dispatched when a member comes back
                    return
                self._finish(req, exc=self._all_dead())
                return
            member = self.members[target]
            engine_now = member.engine
            member.outstanding += 1
            req.member, req.attempt = target, req.attempt + 1
            attempt = req.attempt
            self._requests[req.rid] = req
        try:
            inner = engine_now.generate(req.prompt_ids, req.sampling, req.slot, req.meta)
        except EngineDeadError as err:
            self._settle(member)
            self.drop(member, str(err), engine_now)
            self._redispatch([req])
            return
        except Exception as err:  # bad input: the caller's mistake, on every member alike
            self._settle(member)
            with self._lock:
                self._requests.pop(req.rid, None)
            if raise_errors:
                raise
            self._finish(req, exc=err)
            return
        inner.add_done_callback(lambda f: self._answered(req, member, engine_now, attempt, f))

    def _answered(
        self, req: Request, member: Member, engine: Engine, attempt: int, inner: Future
    ) -> None:
        if member.engine is engine:  # not an engine that left and has been replaced since
            self._settle(member)
        if req.attempt != attempt or req.future.done():
            return  # resubmitted elsewhere meanwhile: this late answer is not the caller's
        err = inner.exception()
        if isinstance(err, EngineDeadError) and not self._closed:
            self.drop(member, str(err), engine)
            # any engine's active slot will do; a named slot is that engine's
            if req.slot == ACTIVE:
                self._redispatch([req])
                return
        if err is not None:
            self._finish(req, exc=err)
            return
        completion = inner.result()
        completion.engine = member.index
        self._finish(req, completion)

    def _settle(self, member: Member) -> None:
        with self._lock:
            member.outstanding -= 1

    def _finish(self, req: Request, result=None, exc: BaseException | None = None) -> None:
        with self._lock:
            self._requests.pop(req.rid, None)
        resolve(req.future, result, exc)

    def _redispatch(self, requests: list[Request]) -> None:
        for req in requests:
            if not req.future.done():
                self._dispatch(req, None)

    # ---- faults --------------------------------------------------------------------------------

    def drop(self, member: Member, reason: str, engine: Engine | None = None) -> None:
        """`member` died or stopped answering: out of the pool, its engine killed, its requests to
        the others. A member already gone stays as it was; so does one whose `engine` (the one that
        failed) has been replaced since by one that came back."""
        with self._lock:
            if (
                not member.alive
                or self._closed
                or (engine is not None and engine is not member.engine)
            ):
                return
            member.alive, member.reason = False, reason
            member.reviving = self._reviver is not None
            left = sum(m.alive for m in self.members)
            if not left:
                self.empty_since = time.monotonic()
            orphans = [
                r for r in self._requests.values() if r.member == member.index and r.slot == ACTIVE
            ]
            self._changed.notify_all()
        self.on_warning(
            f"engine {member.index} left the pool: {reason}; {left} engine(s) left"
            + (f", its {len(orphans)} request(s) resubmitted to them" if orphans and left else "")
            + ("; bringing it back" if member.reviving else "")
        )
        if self.timeline is not None:
            now = time.time()
            self.timeline.event(
                "engine", "lost", now, now, member.version, engine=member.index, reason=reason
            )
        reaper = threading.Thread(target=quietly, args=(member.engine.kill,), daemon=True)
        reaper.start()
        self._reapers.append(reaper)
        self._redispatch(orphans)
        if member.reviving and self._reviver is not None:
            self._reviver(member)
        self._notify()

    def rejoin(self, member: Member, engine: Engine, version: int) -> bool:
        """`engine` (a restarted engine, or the re-checked server) takes `member`'s place, serving
        `version`; the requests held meanwhile go to the pool again. False once the pool is shut
        down (the caller stops the engine)."""
        with self._lock:
            if self._closed:
                return False
            member.engine, member.version, member.outstanding = engine, version, 0
            member.alive, member.reviving, member.reason = True, False, ""
            member.joined_at = time.monotonic()
            self.rejoined += 1
            parked, self._parked = self._parked, []
            self._changed.notify_all()
        self.on_warning(
            f"engine {member.index} rejoined the pool at v{version}; {len(self.alive())} engine(s) "
            "serving"
        )
        if self.timeline is not None:
            now = time.time()
            self.timeline.event("engine", "rejoined", now, now, version, engine=member.index)
        self._redispatch(parked)
        self._notify()
        return True

    def gave_up(self, member: Member, why: str) -> None:
        """`member` will not come back; with no member alive and none coming back, what was held
        fails."""
        with self._lock:
            member.reviving = False
            member.reason = f"{member.reason}; {why}"
            parked = [] if self._hope() or self.alive() else self._parked
            if parked:
                self._parked = []
            self._changed.notify_all()
        for req in parked:
            self._finish(req, exc=self._all_dead())
        self._notify()

    def require_alive(self) -> None:
        """EngineDeadError, naming every member's end, when no member is alive and none is coming
        back."""
        if not self.alive() and not self._hope():
            raise self._all_dead()

    def _hope(self) -> bool:
        return not self._closed and any(m.reviving for m in self.members)

    def _await_member(self) -> list[Member]:
        """The live members; while there are none but one is coming back, wait for it (the reviver's
        own tries and deadline bound the wait)."""
        with self._changed:
            while not self.alive() and self._hope():
                self._changed.wait(1.0)
            return self.alive()

    def _all_dead(self) -> EngineDeadError:
        ends = "; ".join(f"engine {m.index}: {m.reason}" for m in self.members)
        return EngineDeadError(
            f"no engine left ({ends})"
            if len(self.members) > 1
            else self.members[0].reason or "the engine is dead"
        )

    def _watch(self) -> None:
        """Every PING_S, each live member's signs of life (liveness.py): one that neither answers
        nor makes progress for ping_timeout_s is hung; a long step that progresses is not."""
        watched: dict[int, Liveness] = {}
        while not self._stop.wait(PING_S):
            now = time.monotonic()
            for member in self.alive():
                engine = member.engine
                live = watched.get(member.index)
                if live is None or live.engine is not engine:  # new, or came back as another
                    live = watched[member.index] = Liveness(engine, self.ping_timeout_s, now)
                reason = live.check(now)
                if self._stop.is_set():
                    return
                if reason is not None:
                    self.drop(member, reason, engine)

    def _notify(self) -> None:
        for callback in list(self._listeners):
            callback()

    # ---- fan-out -------------------------------------------------------------------------------

    def each(self, call: Callable[[Member], object]) -> list:
        """`call(member)` on every live member, in parallel; a member that dies meanwhile leaves the
        pool (the others go on); EngineDeadError only when none is left (or coming back)."""
        members = self._await_member()
        if not members:
            raise self._all_dead()
        engines = [m.engine for m in members]
        if len(members) == 1:
            outcomes = [outcome(call, members[0])]
        else:
            # the calls move tensors (a push's copy into shared memory): helpers, so that the
            # trainer's OpenMP team stays the process's only one (orbit/host/threads.py)
            with ThreadPoolExecutor(len(members), initializer=helper_thread) as ex:
                outcomes = list(ex.map(lambda m: outcome(call, m), members))
        results = []
        for member, engine, (value, err) in zip(members, engines, outcomes, strict=True):
            if isinstance(err, EngineDeadError):
                self.drop(member, str(err), engine)
            elif err is not None:
                raise err
            else:
                results.append(value)
        if not results:  # every member it ran on left meanwhile
            if not self._await_member():
                raise self._all_dead()
            return self.each(call)
        return results

    def lend_threads(self, n: int) -> None:
        """`n` threads (the waiting trainer's) shared out among the live members, or taken back
        (0). Never blocks: the pipeline calls it under its lock, so it reads the members without
        the pool's (a member that has just left ignores the write)."""
        live = [m for m in self.members if m.alive]
        for i, member in enumerate(live):
            member.engine.lend_threads(n // len(live) + (i < n % len(live)))

    def release_memory(self) -> None:
        self.each(lambda m: m.engine.release_memory())

    def resume_memory(self) -> None:
        self.each(lambda m: m.engine.resume_memory())

    def stats(self) -> EngineStats:
        """The members' counters summed (pauses too: engine-seconds paused); slot facts of the
        first."""
        parts = self.each(lambda m: m.engine.stats())
        return summed(parts)

    def states(self, seconds: float) -> list[tuple[int, EngineStats | BaseException]]:
        """(index, its stats or why there are none) for every member, each live one waited for at
        most `seconds` (for describing a possibly hung pool). One that left, or leaves while asked
        (the ping killed it), gives the pool's reason: that is the cause, not the kill that
        followed."""
        out = []
        for m in self.members:
            answer = bounded(m.engine.stats, seconds) if m.alive else None
            if answer is None or not m.alive:  # it left, maybe while asked: the pool says why
                answer = EngineDeadError(
                    f"left the pool: {m.reason}" + ("; coming back" if m.reviving else "")
                )
            out.append((m.index, answer))
        return out

    def describe(self) -> str:
        with self._lock:
            return "; ".join(
                f"engine {m.index}: v{m.version}, {m.outstanding} in flight"
                if m.alive
                else f"engine {m.index}: {'coming back' if m.reviving else 'gone'} ({m.reason})"
                for m in self.members
            )

    def shutdown(self) -> None:
        """Stop every member (each aborts what is in flight); fail what is still outstanding."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._requests.values()) + self._parked
            self._parked = []
            self._changed.notify_all()
        self._stop.set()
        members = [m for m in self.members if m.alive]
        if members:
            with ThreadPoolExecutor(len(members)) as ex:
                list(ex.map(lambda m: quietly(m.engine.shutdown), members))
        for req in pending:
            self._finish(req, exc=EngineDeadError("engine was shut down"))
        for reaper in self._reapers:
            reaper.join(10)
        if self._monitor.is_alive() and self._monitor is not threading.current_thread():
            self._monitor.join(self.ping_timeout_s + PING_S)

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
