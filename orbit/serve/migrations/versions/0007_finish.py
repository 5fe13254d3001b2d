"""How a session's client finished it (`ServiceClient.close`): success, errored or interrupted,
and its detail; for RestClient.search_sessions' statuses.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as table:
        table.add_column(sa.Column("finish", sa.String(16), nullable=True))
        table.add_column(sa.Column("finish_detail", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sessions") as table:
        table.drop_column("finish_detail")
        table.drop_column("finish")
