"""The SQL sink: schema, migrations, and the fenced transactional apply (docs/contract.md, tables and exactly once)."""
