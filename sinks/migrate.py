"""Schema migrations (Alembic), run by `skillstats init`; idempotent."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from skillstats.sinks.db import sqlite_path

# Our own version table: the registry that owns `skills` may run Alembic too.
VERSION_TABLE = "skillstats_schema_version"
_SCRIPTS = Path(__file__).with_name("migrations")


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(_SCRIPTS))
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE}).get_current_revision()


def upgrade(engine: Engine) -> tuple[str | None, str]:
    """Bring the schema to head; returns (revision before, revision after)."""
    before = current_revision(engine)
    config = _config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
    return before, head_revision()


class SchemaOutdated(RuntimeError):
    """The database is not at the schema this version of skillstats writes: `skillstats init` is the fix, so
    waiting cures nothing (the CLI exits 2)."""


class NoDatabase(SchemaOutdated):
    """The SQLite file the URL names does not exist: `skillstats init` not run yet, or a wrong path."""


def require_current(engine: Engine) -> None:
    """Fail early, with the fix in the message, rather than on the first missing table.

    A SQLite file that does not exist is not created here (connecting would leave
    an empty one behind): only `skillstats init` creates the database. Costs one
    stat() and one read of the version table.
    """
    path = sqlite_path(engine.url.render_as_string(hide_password=False))
    if path is not None and not path.exists():
        raise NoDatabase(
            f"no database at {path}: run 'skillstats init' (it creates it), or check SKILLSTATS_DATABASE_URL "
            f"(--database-url)"
        )
    current, head = current_revision(engine), head_revision()
    if current != head:
        raise SchemaOutdated(
            f"the database schema is at revision {current or 'none'}, this skillstats needs {head}: "
            f"run 'skillstats init' (it migrates, keeping the data)"
        )
