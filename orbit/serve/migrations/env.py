"""Alembic's environment for the service's database: the connection is the one Store.migrate
passes (config.attributes["connection"]); the target schema is store.py's tables."""

from alembic import context

from orbit.serve.store import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters a table by copying it
)
with context.begin_transaction():
    context.run_migrations()
