"""Every benchmark in one run and one table: per-call overhead, then the 110M stack.

    python benchmarks/run_all.py [--quick] [--json out.json] [--engines delegate,eager]
"""

from __future__ import annotations

import overhead
import stack
from common import main

if __name__ == "__main__":
    main(__doc__.splitlines()[0], [overhead.workloads, stack.workloads])
