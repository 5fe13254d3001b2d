"""The service's database (orbit/serve/store.py), one piece on its own: its migrations make the
schema its tables declare, a restart fails exactly its own running futures and loses exactly its
own clients, what ended before a restart is answered as it ended, and the keys file. The whole
service: tests/test_serve_service.py."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from orbit.serve.futures import Futures, RequestFailed, result_of
from orbit.serve.keys import Keys, KeysError, read_keys, tenant_of
from orbit.serve.store import Base, ClientRow, Outcome, Store, migrate


def _store(tmp_path, instance: str = "host:/serve") -> Store:
    return Store(f"sqlite:///{tmp_path / 'serve.db'}", instance)


def _client(store: Store, model_id: str) -> None:
    now = time.time()
    store.add_client(
        ClientRow(id=model_id, instance=store.instance, tenant="t", session="s",
                  base_model="m", rank=4, seed=None, train_attn=True, train_mlp=True,
                  train_unembed=True, user_metadata={}, created=now, last_request=now,
                  alive=True, last_state=None)
    )  # fmt: skip


def test_the_migrations_make_the_declared_schema(tmp_path):
    store = _store(tmp_path)
    with store.engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    store.close()
    _store(tmp_path).close()  # opening it again migrates nothing and fails nothing


def test_sessions_a_client_finished_before_0007_keep_how(tmp_path):
    """Migration 0007 reads how a client finished its session from the end reason the service
    wrote before it stored it."""
    from sqlalchemy import create_engine, text

    engine = create_engine(f"sqlite:///{tmp_path / 'serve.db'}")
    migrate(engine, "0006")
    insert = text(
        "INSERT INTO sessions (id, tenant, user_metadata, created, seen, ended, end_reason) "
        "VALUES (:id, 't', '{}', 1.0, 1.0, 2.0, :why)"
    )
    with engine.begin() as connection:
        connection.execute(insert, {"id": "a", "why": "finished by its client (errored)"})
        connection.execute(insert, {"id": "b", "why": "no heartbeat for 300 s"})
    engine.dispose()
    store = _store(tmp_path)  # migrates to the newest
    assert store.session("a").finish == "errored" and store.session("b").finish is None
    store.close()


def test_a_restart_fails_its_running_futures_and_answers_the_rest(tmp_path):
    store = _store(tmp_path)
    futures = Futures(store)
    done, running = futures.new("OptimStep", "t"), futures.new("ForwardBackward", "t", proto=True)
    done.future.set_result({"metrics": {"grad_norm": 1.5}})
    _client(store, "s:train:0")
    other = Store(store.url, "other-host:/serve")  # a second process on the same database
    other_running = Futures(other).new("Sample", "t")
    store.close()

    again = _store(tmp_path)
    assert again.recover("restarted") == (1, 1)
    futures = Futures(again)
    answered = result_of(futures.get(done.id, "t"))
    assert answered == (b'{"metrics": {"grad_norm": 1.5}}', False)
    failed = result_of(futures.get(running.id, "t"))
    assert isinstance(failed, RequestFailed) and str(failed) == "restarted"
    assert failed.category == "server"
    assert futures.get(done.id, "someone else") is None  # another tenant's: not found
    assert not again.client("s:train:0").alive
    assert other.future(other_running.id) == ("t", None)  # the other process's: still running


def test_a_keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# the team\ntml-alice-1\n\ntml-bob-2\n")
    keys = read_keys(path)
    assert keys.tenant("tml-alice-1") == tenant_of("tml-alice-1") != keys.tenant("tml-bob-2")
    assert keys.tenant("tml-carol") is None and keys.tenant(None) is None
    assert Keys().tenant(None) == Keys().tenant("tml-anything") == "local"
    for text, says in (("tml-a\nsk-not-tinker\n", "line 2"), ("# none\n", "no keys")):
        path.write_text(text)
        with pytest.raises(KeysError, match=says):
            read_keys(path)


def test_a_replaced_directory_is_the_old_or_the_new_one_after_a_kill(tmp_path):
    from orbit.host.files import recover_dir, write_dir

    target = tmp_path / "latest"
    write_dir(target, lambda d: (d / "v").write_text("1"))
    write_dir(target, lambda d: (d / "v").write_text("2"), replace=True)
    assert (target / "v").read_text() == "2" and [p.name for p in tmp_path.iterdir()] == ["latest"]
    # a kill after the old one was set aside, before the new one was renamed in: the old comes back
    target.rename(tmp_path / ".latest.0a1b2c3d.old")
    (tmp_path / ".latest.9f8e7d6c.tmp").mkdir()
    recover_dir(tmp_path)
    assert (target / "v").read_text() == "2" and [p.name for p in tmp_path.iterdir()] == ["latest"]


POSTGRES = Path("/usr/lib/postgresql")


@pytest.fixture
def postgres():
    """A throwaway PostgreSQL server on 127.0.0.1 (Debian's binaries; initdb refuses root, so as
    `nobody` there, in a directory of its own under /tmp), stopped and removed after the test: its
    URL."""
    bins = sorted(POSTGRES.glob("*/bin/initdb"))
    if not bins or importlib.util.find_spec("psycopg") is None:
        pytest.skip("no PostgreSQL server binaries or no psycopg here")
    bindir = bins[-1].parent
    # under /tmp itself: the test process's own temporary directory may be one only root can enter
    with tempfile.TemporaryDirectory(prefix="orbit-pg-", dir="/tmp") as tmp:
        yield from _postgres(bindir, Path(tmp))


def _postgres(bindir: Path, home: Path):
    as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
    if as_user:
        shutil.chown(home, "nobody")
    data, port = home / "data", _free_port()
    run = functools.partial(subprocess.run, check=True, capture_output=True, timeout=60)
    run([*as_user, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "orbit"])
    options = f"-k {home} -p {port} -c listen_addresses=127.0.0.1"
    pg_ctl = [*as_user, str(bindir / "pg_ctl"), "-D", str(data)]
    run([*pg_ctl, "-o", options, "-l", str(home / "log"), "-w", "start"])
    try:
        yield f"postgresql+psycopg://orbit@127.0.0.1:{port}/postgres"
    finally:
        run([*pg_ctl, "-m", "immediate", "-w", "stop"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_same_store_on_postgresql(postgres):
    """A team's service keeps its state in PostgreSQL by URL: the same migrations, the same
    recovery, two processes on one database each recovering its own."""
    first, second = Store(postgres, "host-a:/serve"), Store(postgres, "host-b:/serve")
    with first.engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    mine, theirs = Futures(first).new("OptimStep", "t"), Futures(second).new("Sample", "t")
    _client(first, "s:train:0")
    first.close()
    again = Store(postgres, "host-a:/serve")
    assert again.recover("restarted") == (1, 1)
    assert again.future(mine.id) == ("t", Outcome(False, None, "restarted", "server"))
    assert again.future(theirs.id) == ("t", None)  # host b's request runs on
    again.close()
    second.close()
