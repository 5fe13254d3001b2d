"""The service's state in a database: tenants' sessions, training clients, sampling sessions,
futures, checkpoints and the sequences sampled with record_stability_info, so that a restart loses
nothing a client was told. SQLite in the serve directory by default; any URL SQLAlchemy speaks
(PostgreSQL for a service on several hosts). The schema is these tables; its changes are Alembic
migrations (orbit/serve/migrations), applied when the store opens.

Each row that only one `orbit serve` process can act on (a client's adapter, a running future, a
checkpoint in its directory, a snapshot) carries that process's `instance` (its host and serve
directory), so that processes sharing one database recover only their own after a restart.

What lives only in memory, and why: a training client's adapter and optimizer (the trainer's, in
the shared base; `save_state` writes them to disk), and the concurrent futures a poll waits on. A
row says what outlives a restart: a client that was alive is marked lost, a future that was running
is failed with the reason.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Float,
    Integer,
    LargeBinary,
    String,
    Text,
    create_engine,
    delete,
    event,
    false,
    func,
    select,
    update,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

MIGRATIONS = Path(__file__).with_name("migrations")


class Base(DeclarativeBase):
    pass


class SessionRow(Base):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON)
    created: Mapped[float] = mapped_column(Float)
    seen: Mapped[float] = mapped_column(Float)  # its newest heartbeat
    ended: Mapped[float | None] = mapped_column(Float, nullable=True)
    end_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    tags: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    display_name: Mapped[str | None] = mapped_column(Text, nullable=True)
    # how its client finished it (ServiceClient.close): success, errored or interrupted
    finish: Mapped[str | None] = mapped_column(String(16), nullable=True)
    finish_detail: Mapped[str | None] = mapped_column(Text, nullable=True)


class ClientRow(Base):
    """A training client: its LoRA as created, and whether its adapter is in this process."""

    __tablename__ = "clients"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    instance: Mapped[str] = mapped_column(String(512), index=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    session: Mapped[str] = mapped_column(String(64))
    base_model: Mapped[str] = mapped_column(Text)
    rank: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int | None] = mapped_column(Integer, nullable=True)
    train_attn: Mapped[bool] = mapped_column(Boolean)
    train_mlp: Mapped[bool] = mapped_column(Boolean)
    train_unembed: Mapped[bool] = mapped_column(Boolean)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON)
    created: Mapped[float] = mapped_column(Float)
    last_request: Mapped[float] = mapped_column(Float)
    alive: Mapped[bool] = mapped_column(Boolean)  # False once its adapter is gone
    last_state: Mapped[str | None] = mapped_column(Text, nullable=True)  # newest save_state
    # why it is gone: unloaded, or its session ended (None while alive, or lost in a restart)
    end_reason: Mapped[str | None] = mapped_column(Text, nullable=True)


class SamplerRow(Base):
    """A sampling session: the base model, a checkpoint, a snapshot written under the serve
    directory, or a training client's inflight target."""

    __tablename__ = "samplers"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    instance: Mapped[str] = mapped_column(String(512), index=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    base_model: Mapped[str] = mapped_column(Text)
    model_path: Mapped[str | None] = mapped_column(Text, nullable=True)  # tinker://...
    snapshot: Mapped[str | None] = mapped_column(Text, nullable=True)  # a directory
    created: Mapped[float] = mapped_column(Float)
    # an inflight session: the training client whose target it samples (snapshot: the target's
    # newest version on disk, shared by the target's sessions)
    target: Mapped[str | None] = mapped_column(String(128), nullable=True)


class FutureRow(Base):
    __tablename__ = "futures"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    instance: Mapped[str] = mapped_column(String(512), index=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    kind: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16), index=True)  # pending | done | failed
    proto: Mapped[bool] = mapped_column(Boolean)
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    category: Mapped[str | None] = mapped_column(String(16), nullable=True)
    created: Mapped[float] = mapped_column(Float)
    done_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    path: Mapped[str] = mapped_column(String(512), primary_key=True)  # tinker://client/kind/name
    instance: Mapped[str] = mapped_column(String(512), index=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    client: Mapped[str] = mapped_column(String(128), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(255))
    directory: Mapped[str] = mapped_column(Text)
    created: Mapped[float] = mapped_column(Float)
    size_bytes: Mapped[int] = mapped_column(Integer)
    expires: Mapped[float | None] = mapped_column(Float, nullable=True)  # its TTL's end (time.time)
    user_metadata: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    # published: any tenant reads it
    public: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class RecordedRow(Base):
    """A sequence sampled with record_stability_info: what stable_reinforce's training requests
    name by its sequence_id (orbit/serve/provenance.py). Kept a day after its last use."""

    __tablename__ = "recorded_sequences"
    id: Mapped[str] = mapped_column(String(160), primary_key=True)  # the SDK's sequence_id
    tenant: Mapped[str] = mapped_column(String(64))
    session: Mapped[str] = mapped_column(String(64))  # the SDK session that sampled it
    prompt: Mapped[list[int]] = mapped_column(JSON)
    tokens: Mapped[list[int]] = mapped_column(JSON)  # the sampled tokens
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)  # the sampler's, float32
    used: Mapped[float] = mapped_column(Float, index=True)  # recorded, or last trained on
    # the base model it was sampled on, as its sampling session names it (None: recorded before
    # a service had more than one)
    base: Mapped[str | None] = mapped_column(Text, nullable=True)


@dataclass(frozen=True)
class Outcome:
    """A finished future as stored: its result's bytes (JSON text unless `proto`), or its error."""

    proto: bool
    result: bytes | None
    error: str | None
    category: str | None


def instance(directory: Path) -> str:
    """Which `orbit serve` process a row is for: its host and serve directory (a restart on the
    same directory is the same one)."""
    return f"{socket.gethostname()}:{directory.resolve()}"


def default_url(directory: Path) -> str:
    return f"sqlite:///{(directory / 'orbit-serve.db').resolve()}"


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL: readers (the REST routes) never wait for the trainer's writes; a write is on disk once
    # its transaction commits (synchronous FULL), so what a client was told survives a kill -9
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


class Store:
    """The database behind one `orbit serve` (or several, sharing a PostgreSQL)."""

    def __init__(self, url: str, instance: str = "") -> None:
        self.url, self.instance = url, instance
        sqlite = url.startswith("sqlite")
        self.engine: Engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30} if sqlite else {},
            pool_pre_ping=not sqlite,
        )
        if sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._lock = threading.Lock() if sqlite else None  # SQLite: one writer at a time
        migrate(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        if self._lock is None:
            with Session(self.engine, expire_on_commit=False) as s, s.begin():
                yield s
            return
        with self._lock, Session(self.engine, expire_on_commit=False) as s, s.begin():
            yield s

    # -- after a restart -------------------------------------------------------------------

    def recover(self, reason: str) -> tuple[int, int]:
        """What a restart ended: running futures fail with `reason`, live clients are lost.
        (futures failed, clients lost)."""
        now = time.time()
        pending = (FutureRow.state == "pending") & (FutureRow.instance == self.instance)
        alive = ClientRow.alive.is_(True) & (ClientRow.instance == self.instance)
        with self._tx() as s:
            futures = s.scalar(select(func.count()).select_from(FutureRow).where(pending))
            clients = s.scalar(select(func.count()).select_from(ClientRow).where(alive))
            s.execute(
                update(FutureRow)
                .where(pending)
                .values(state="failed", error=reason, category="server", done_at=now)
            )
            s.execute(update(ClientRow).where(alive).values(alive=False))
            # a session's silence is counted from this start, not across the restart
            s.execute(update(SessionRow).where(SessionRow.ended.is_(None)).values(seen=now))
        return int(futures or 0), int(clients or 0)

    # -- sessions ---------------------------------------------------------------------------

    def add_session(self, row: SessionRow) -> None:
        with self._tx() as s:
            s.add(row)

    def session(self, session_id: str) -> SessionRow | None:
        with self._tx() as s:
            return s.get(SessionRow, session_id)

    def sessions(self, tenant: str) -> list[SessionRow]:
        """The tenant's sessions, newest first."""
        query = select(SessionRow).where(SessionRow.tenant == tenant)
        with self._tx() as s:
            return list(s.scalars(query.order_by(SessionRow.created.desc())))

    def seen(self, session_id: str) -> None:
        with self._tx() as s:
            s.execute(
                update(SessionRow).where(SessionRow.id == session_id).values(seen=time.time())
            )

    def end_session(
        self, session_id: str, reason: str, finish: str | None = None, detail: str | None = None
    ) -> None:
        """Mark the session ended (the first reason stays); `finish` and `detail`: how its client
        finished it, when it did."""
        ended = {"ended": time.time(), "end_reason": reason, "finish": finish}
        with self._tx() as s:
            s.execute(
                update(SessionRow)
                .where(SessionRow.id == session_id, SessionRow.ended.is_(None))
                .values(**ended, finish_detail=detail)
            )

    def silent_sessions(self, since: float) -> list[str]:
        """Sessions of any tenant, not ended, whose newest heartbeat is older than `since`."""
        query = select(SessionRow.id).where(SessionRow.ended.is_(None), SessionRow.seen < since)
        with self._tx() as s:
            return list(s.scalars(query))

    # -- training clients -------------------------------------------------------------------

    def add_client(self, row: ClientRow) -> None:
        with self._tx() as s:
            s.merge(row)

    def client(self, model_id: str) -> ClientRow | None:
        with self._tx() as s:
            return s.get(ClientRow, model_id)

    def clients(self, tenant: str | None = None) -> list[ClientRow]:
        """The tenant's training clients (None: every tenant's)."""
        query = select(ClientRow).order_by(ClientRow.tenant, ClientRow.created)
        if tenant is not None:
            query = query.where(ClientRow.tenant == tenant)
        with self._tx() as s:
            return list(s.scalars(query))

    def live_clients(self, tenant: str) -> int:
        with self._tx() as s:
            query = select(func.count()).where(ClientRow.tenant == tenant, ClientRow.alive)
            return int(s.scalar(query.select_from(ClientRow)) or 0)

    def ended_clients(self) -> list[tuple[str, str]]:
        """This instance's live training clients whose session ended: (client, the end's reason)."""
        query = (
            select(ClientRow.id, SessionRow.end_reason)
            .join(SessionRow, SessionRow.id == ClientRow.session)
            .where(
                ClientRow.instance == self.instance,
                ClientRow.alive,
                SessionRow.ended.is_not(None),
            )
        )
        with self._tx() as s:
            return [(c, r or "") for c, r in s.execute(query)]

    def ended_samplers(self) -> list[SamplerRow]:
        """This instance's sampling sessions (`{session}:sample:{n}`) whose session ended."""
        ended = select(SessionRow.id).where(SessionRow.ended.is_not(None))
        with self._tx() as s:
            done = set(s.scalars(ended))
            rows = s.scalars(select(SamplerRow).where(SamplerRow.instance == self.instance))
            return [r for r in rows if r.id.split(":")[0] in done]

    def end_client(self, model_id: str, reason: str) -> None:
        with self._tx() as s:
            s.execute(
                update(ClientRow)
                .where(ClientRow.id == model_id)
                .values(alive=False, end_reason=reason)
            )

    def touch_client(self, model_id: str, last_state: str | None = None) -> None:
        values: dict[str, Any] = {"last_request": time.time()}
        if last_state is not None:
            values["last_state"] = last_state
        with self._tx() as s:
            s.execute(update(ClientRow).where(ClientRow.id == model_id).values(**values))

    # -- sampling sessions ------------------------------------------------------------------

    def add_sampler(self, row: SamplerRow) -> None:
        with self._tx() as s:
            s.merge(row)

    def sampler(self, sampler_id: str) -> SamplerRow | None:
        with self._tx() as s:
            return s.get(SamplerRow, sampler_id)

    def samplers(self) -> list[SamplerRow]:
        with self._tx() as s:
            return list(s.scalars(select(SamplerRow)))

    def drop_sampler(self, sampler_id: str) -> None:
        with self._tx() as s:
            s.execute(delete(SamplerRow).where(SamplerRow.id == sampler_id))

    # -- futures ----------------------------------------------------------------------------

    def add_future(self, future_id: str, tenant: str, kind: str, proto: bool) -> None:
        row = FutureRow(
            id=future_id,
            instance=self.instance,
            tenant=tenant,
            kind=kind,
            state="pending",
            proto=proto,
            created=time.time(),
        )
        with self._tx() as s:
            s.add(row)

    def finish_future(
        self, future_id: str, result: Any = None, error: str | None = None, category: str = ""
    ) -> None:
        if error is None:
            data = result if isinstance(result, bytes) else json.dumps(result).encode()
            values: dict[str, Any] = {"state": "done", "result": data}
        else:
            values = {"state": "failed", "error": error, "category": category or "server"}
        with self._tx() as s:
            s.execute(
                update(FutureRow)
                .where(FutureRow.id == future_id)
                .values(done_at=time.time(), **values)
            )

    def future(self, future_id: str) -> tuple[str, Outcome | None] | None:
        """(tenant, its outcome: None while it runs), or None for an id never issued."""
        with self._tx() as s:
            row = s.get(FutureRow, future_id)
        if row is None:
            return None
        if row.state == "pending":
            return row.tenant, None
        return row.tenant, Outcome(row.proto, row.result, row.error, row.category)

    def purge_futures(self, older_than: float) -> None:
        with self._tx() as s:
            s.execute(
                delete(FutureRow).where(
                    FutureRow.state != "pending", FutureRow.done_at < older_than
                )
            )

    # -- checkpoints ------------------------------------------------------------------------

    def add_checkpoint(self, row: CheckpointRow) -> None:
        with self._tx() as s:
            s.merge(row)

    def checkpoint(self, path: str) -> CheckpointRow | None:
        with self._tx() as s:
            return s.get(CheckpointRow, path)

    def checkpoints(
        self, tenant: str | None = None, client: str | None = None, mine: bool = False
    ) -> list[CheckpointRow]:
        """A tenant's checkpoints (None: every tenant's), a client's, or this process's."""
        query = select(CheckpointRow).order_by(CheckpointRow.created)
        if mine:
            query = query.where(CheckpointRow.instance == self.instance)
        if tenant is not None:
            query = query.where(CheckpointRow.tenant == tenant)
        if client is not None:
            query = query.where(CheckpointRow.client == client)
        with self._tx() as s:
            return list(s.scalars(query))

    def set_expiry(self, path: str, expires: float | None) -> None:
        with self._tx() as s:
            s.execute(
                update(CheckpointRow).where(CheckpointRow.path == path).values(expires=expires)
            )

    def set_public(self, path: str, public: bool) -> None:
        with self._tx() as s:
            s.execute(update(CheckpointRow).where(CheckpointRow.path == path).values(public=public))

    def expired_checkpoints(self, now: float) -> list[CheckpointRow]:
        """This process's checkpoints whose TTL ended by `now`."""
        query = select(CheckpointRow).where(
            CheckpointRow.instance == self.instance,
            CheckpointRow.expires.is_not(None),
            CheckpointRow.expires <= now,
        )
        with self._tx() as s:
            return list(s.scalars(query))

    def drop_checkpoint(self, path: str) -> None:
        with self._tx() as s:
            s.execute(delete(CheckpointRow).where(CheckpointRow.path == path))

    # -- recorded sequences (stable_reinforce) ----------------------------------------------

    def add_recorded(self, rows: list[RecordedRow]) -> None:
        with self._tx() as s:
            s.add_all(rows)

    def recorded(self, tenant: str, ids: list[str]) -> dict[str, RecordedRow]:
        """The tenant's recorded sequences among `ids`, by id; each found one's day starts again
        now (another tenant's are not found, and their day is theirs)."""
        with self._tx() as s:
            query = select(RecordedRow).where(RecordedRow.id.in_(ids), RecordedRow.tenant == tenant)
            rows = list(s.scalars(query))
            if rows:
                s.execute(
                    update(RecordedRow)
                    .where(RecordedRow.id.in_([r.id for r in rows]))
                    .values(used=time.time())
                )
        return {r.id: r for r in rows}

    def purge_recorded(self, older_than: float) -> int:
        """Recorded sequences last used before `older_than` are deleted; how many."""
        with self._tx() as s:
            gone = s.execute(delete(RecordedRow).where(RecordedRow.used < older_than))
        return int(getattr(gone, "rowcount", 0) or 0)


def migrate(engine: Engine, revision: str = "head") -> None:
    """Bring the database's schema to the newest migration (a new database: all of them), or to
    `revision`."""
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
