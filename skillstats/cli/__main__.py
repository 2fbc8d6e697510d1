"""`python -m skillstats.cli`: the same as the `skillstats` command."""

import sys

from skillstats.cli import main

sys.exit(main())
