"""Inflight sampling sessions: the training client whose mutable target a session samples.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("samplers") as table:
        table.add_column(sa.Column("target", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samplers") as table:
        table.drop_column("target")
