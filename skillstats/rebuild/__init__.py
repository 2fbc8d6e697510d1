"""Recomputing the windows tables from the log beside the live ones, and swapping them in (`skillstats rebuild`).

The day the tables are wrong for a reason the fences cannot see (a release that
counted a kind wrongly, a row edited by hand), the log still holds what
happened. A rebuild is a windows worker of its own group writing shadow tables
(`skillstats windows --rebuild`), exact for the reasons the live worker is;
`rebuild diff` compares the two over the days the rebuild owns (an audit, when
never swapped); `rebuild swap` puts the rebuilt tables in place in one
transaction while the live worker runs on; `rebuild rollback` puts the previous
ones back. One concern per module:

- `log`: where a day's records begin in the log, and the records between two positions;
- `state`: a rebuild as the database records it;
- `generations`: start, swap, rollback, drop: each change of generation, one transaction;
- `report`: status and diff, read-only;
- `worker`: what the windows worker does differently for a rebuild.

The SQL side (the generations' tables, the days a rebuild owns, the renames) is sinks/rebuild.py.
"""
