"""How a session's client finished it (`ServiceClient.close`): success, errored or interrupted,
and its detail, for RestClient.search_sessions' statuses (sessions the client finished before this
are read from their end reason); and the base model a recorded sequence was sampled on, for
stable_reinforce's provenance once a service serves several.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

FINISHES = ("success", "errored", "interrupted")


def upgrade() -> None:
    with op.batch_alter_table("sessions") as table:
        table.add_column(sa.Column("finish", sa.String(16), nullable=True))
        table.add_column(sa.Column("finish_detail", sa.Text(), nullable=True))
    sessions = sa.table("sessions", sa.column("end_reason"), sa.column("finish"))
    for finish in FINISHES:  # the end reason the service wrote for them
        reason = f"finished by its client ({finish})"
        op.execute(sessions.update().where(sessions.c.end_reason == reason).values(finish=finish))
    with op.batch_alter_table("recorded_sequences") as table:
        table.add_column(sa.Column("base", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("recorded_sequences") as table:
        table.drop_column("base")
    with op.batch_alter_table("sessions") as table:
        table.drop_column("finish_detail")
        table.drop_column("finish")
