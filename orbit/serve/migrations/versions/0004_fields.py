"""Fields the SDK sends, kept: a session's tags and display name, a checkpoint's TTL and user
metadata.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as table:
        table.add_column(sa.Column("tags", sa.JSON(), nullable=True))
        table.add_column(sa.Column("display_name", sa.Text(), nullable=True))
    with op.batch_alter_table("checkpoints") as table:
        table.add_column(sa.Column("expires", sa.Float(), nullable=True))
        table.add_column(sa.Column("user_metadata", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as table:
        table.drop_column("user_metadata")
        table.drop_column("expires")
    with op.batch_alter_table("sessions") as table:
        table.drop_column("display_name")
        table.drop_column("tags")
