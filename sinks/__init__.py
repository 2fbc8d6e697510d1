"""The SQL sink: schema, migrations, and the fenced transactional apply (SPEC §4-5)."""
