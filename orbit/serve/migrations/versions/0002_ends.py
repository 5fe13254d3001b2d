"""Clients that end: a session's end (finished by its client, or its heartbeat stopped) and why; a
training client's end (unloaded, or its session ended) and why.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as table:
        table.add_column(sa.Column("ended", sa.Float(), nullable=True))
        table.add_column(sa.Column("end_reason", sa.Text(), nullable=True))
    with op.batch_alter_table("clients") as table:
        table.add_column(sa.Column("end_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("clients") as table:
        table.drop_column("end_reason")
    with op.batch_alter_table("sessions") as table:
        table.drop_column("end_reason")
        table.drop_column("ended")
