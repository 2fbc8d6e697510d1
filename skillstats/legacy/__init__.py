"""Moving in from the legacy system: a Convex export of its stat events, counted once (`skillstats legacy`).

The system skillstats replaces kept stat events in a Convex table drained by two crons, each with
its own progress marker: the daily processor's cursor (`skillStatUpdateCursors`, by
`_creationTime`) for the daily and hourly stats, and the doc sync's `processedAt` for the skills'
totals. An event's counts are owed to exactly the tables whose cron had not reached it. One concern
per module:

- `export`: reads an export (ZIP or directory) streaming and refuses, in one line naming the file
  and the line, anything that does not fit the old schema (what fits it but lies outside the
  contract's ranges is marked, for the plan to count and the import to skip only when told);
- `plan`: what an import would do, and the old system's own survivor figures, with no writes;
- `importer`: applies it in bounded chunks, a transaction each, under the manifest
  (`skillstats_legacy_manifest`) that makes it idempotent.
"""
