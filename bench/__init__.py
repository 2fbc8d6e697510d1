"""`skillstats bench`: where the time goes, measured in one run on one machine.

For each workload (`steady`: what a live registry sends; `backfill`: a week of
history replayed), preloads a fresh topic, then runs each consumer in a process
of its own, from a cold start until it has caught up with the preloaded
records, and reports for each: the steady rate from its first record to caught
up, the ratio of that rate to the bare confluent-kafka loop (the ceiling on
this machine), the process's CPU seconds per million events (user + system,
process start to exit, from `wait4`), the SQL rows its upserts wrote per
second, the wall time from process start and the peak RSS. A second part
offers a steady load and measures publish-to-visible-in-SQL latency; a third
(case i) measures `skillstats ingest` beside the direct Python publisher; a
fourth (case j) `skillstats legacy import` of a synthetic Convex export.

One concern per module:

- `workload`: the workloads (definitions only);
- `roles`: the consumers run as `python -m skillstats_bench ROLE ...`, each measured in isolation;
- `measure`: timing a consumer's process (steady rate, CPU, peak RSS), the docsync drain, perf-test;
- `stages`: the windows sink's stages apart (fetch, decode, fold, SQL), `python -m skillstats_bench stages`;
- `latency`: publish -> visible in SQL under a steady offered load;
- `soak`: the windows worker's memory over a long run (`--soak-events`);
- `report`: the markdown tables;
- `run`: preloading each workload and running the cases in order;
- `cli`: the options and the entry point `skillstats bench` calls;
- `ingest`: case i, HTTP ingest beside the direct publisher;
- `legacy_export`: a synthetic export of the legacy system (a streaming model of its crons), shared
  with the tests; `legacy_import`: case j, `skillstats legacy import` of one.
"""

from .cli import add_arguments, main_from_cli
from .roles import run_role
from .workload import WORKLOADS, workload_names

__all__ = ["WORKLOADS", "add_arguments", "main_from_cli", "run_role", "workload_names"]
