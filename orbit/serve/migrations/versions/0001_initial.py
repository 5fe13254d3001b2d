"""The first schema: sessions, training clients, sampling sessions, futures and checkpoints.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False, index=True),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("created", sa.Float(), nullable=False),
        sa.Column("seen", sa.Float(), nullable=False),
    )
    op.create_table(
        "clients",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("instance", sa.String(512), nullable=False, index=True),
        sa.Column("tenant", sa.String(64), nullable=False, index=True),
        sa.Column("session", sa.String(64), nullable=False),
        sa.Column("base_model", sa.Text(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=True),
        sa.Column("train_attn", sa.Boolean(), nullable=False),
        sa.Column("train_mlp", sa.Boolean(), nullable=False),
        sa.Column("train_unembed", sa.Boolean(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("created", sa.Float(), nullable=False),
        sa.Column("last_request", sa.Float(), nullable=False),
        sa.Column("alive", sa.Boolean(), nullable=False),
        sa.Column("last_state", sa.Text(), nullable=True),
    )
    op.create_table(
        "samplers",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("instance", sa.String(512), nullable=False, index=True),
        sa.Column("tenant", sa.String(64), nullable=False, index=True),
        sa.Column("base_model", sa.Text(), nullable=False),
        sa.Column("model_path", sa.Text(), nullable=True),
        sa.Column("snapshot", sa.Text(), nullable=True),
        sa.Column("created", sa.Float(), nullable=False),
    )
    op.create_table(
        "futures",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("instance", sa.String(512), nullable=False, index=True),
        sa.Column("tenant", sa.String(64), nullable=False, index=True),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("proto", sa.Boolean(), nullable=False),
        sa.Column("result", sa.LargeBinary(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("category", sa.String(16), nullable=True),
        sa.Column("created", sa.Float(), nullable=False),
        sa.Column("done_at", sa.Float(), nullable=True),
    )
    op.create_table(
        "checkpoints",
        sa.Column("path", sa.String(512), primary_key=True),
        sa.Column("instance", sa.String(512), nullable=False, index=True),
        sa.Column("tenant", sa.String(64), nullable=False, index=True),
        sa.Column("client", sa.String(128), nullable=False, index=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("directory", sa.Text(), nullable=False),
        sa.Column("created", sa.Float(), nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=False),
    )


def downgrade() -> None:
    for table in ("checkpoints", "futures", "samplers", "clients", "sessions"):
        op.drop_table(table)
