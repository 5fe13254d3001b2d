"""Sequences sampled with record_stability_info, for stable_reinforce's training requests.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "recorded_sequences",
        sa.Column("id", sa.String(160), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("session", sa.String(64), nullable=False),
        sa.Column("prompt", sa.JSON(), nullable=False),
        sa.Column("tokens", sa.JSON(), nullable=False),
        sa.Column("logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("used", sa.Float(), nullable=False, index=True),
    )


def downgrade() -> None:
    op.drop_table("recorded_sequences")
