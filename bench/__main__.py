"""`python -m skillstats_bench ROLE ...`: run one measured consumer in isolation (the benchmark spawns these)."""

import sys

from skillstats_bench import run_role

run_role(sys.argv[1:])
