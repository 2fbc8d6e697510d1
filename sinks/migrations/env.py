"""Alembic environment: always driven from `skillstats init` with an open connection."""

from __future__ import annotations

from alembic import context

from skillstats.sinks.migrate import VERSION_TABLE

connection = context.config.attributes["connection"]
context.configure(connection=connection, version_table=VERSION_TABLE, transaction_per_migration=True)
with context.begin_transaction():
    context.run_migrations()
