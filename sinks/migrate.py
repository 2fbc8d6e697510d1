"""Schema migrations (Alembic), run by `skillstats init`; idempotent."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine, inspect, text

from skillstats.sinks.db import sqlite_path

if TYPE_CHECKING:
    from alembic.config import Config

# Our own version table: the registry that owns `skills` may run Alembic too.
VERSION_TABLE = "skillstats_schema_version"
# The newest revision in migrations/versions: the schema this version of skillstats writes. Said here, not read
# from the scripts, so that every command's start-up check (require_current) needs no Alembic: importing it (with
# Mako and Pygments) cost 0.2-0.45 CPU seconds per process, more than SQLAlchemy's own. tests/test_sink.py fails
# when a migration is added and this is not moved to it.
HEAD_REVISION = "0012"
_SCRIPTS = Path(__file__).with_name("migrations")


def _config() -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(_SCRIPTS))
    return config


def head_revision() -> str:
    """The head of the migration scripts, as Alembic reads them (HEAD_REVISION is the start-up check's copy)."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE}).get_current_revision()


def upgrade(engine: Engine) -> tuple[str | None, str]:
    """Bring the schema to head; returns (revision before, revision after)."""
    from alembic import command

    before = current_revision(engine)
    config = _config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
    return before, head_revision()


class SchemaOutdated(RuntimeError):
    """The database is not at the schema this version of skillstats writes: `skillstats init` is the fix, so
    waiting cures nothing (the CLI exits 2)."""


class MigrationRefused(RuntimeError):
    """A migration would drop something of the operator's (an index, trigger or column on a table it copies): the
    message names it and says what to do, nothing was changed, and running again does not help (the CLI exits 2).
    Migrations raise it; a frozen migration may import it, since it stays here."""


class NoDatabase(SchemaOutdated):
    """The SQLite file the URL names does not exist: `skillstats init` not run yet, or a wrong path."""


def require_current(engine: Engine) -> None:
    """Fail early, with the fix in the message, rather than on the first missing table.

    A SQLite file that does not exist is not created here (connecting would leave
    an empty one behind): only `skillstats init` creates the database. Costs one
    stat() and one read of the version table, without importing Alembic.
    """
    path = sqlite_path(engine.url.render_as_string(hide_password=False))
    if path is not None and not path.exists():
        raise NoDatabase(
            f"no database at {path}: run 'skillstats init' (it creates it), or check SKILLSTATS_DATABASE_URL "
            f"(--database-url)"
        )
    with engine.connect() as connection:
        found = (
            sorted(str(row[0]) for row in connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")))
            if inspect(connection).has_table(VERSION_TABLE)
            else []
        )
    if found != [HEAD_REVISION]:
        raise SchemaOutdated(
            f"the database schema is at revision {', '.join(found) or 'none'}, this skillstats needs {HEAD_REVISION}: "
            f"run 'skillstats init' (it migrates, keeping the data)"
        )
