"""Progress of long lowering work, as log records on one logger.

Library code reports stages here; the CLI prints them (`[mlx-delegate] ...` on
stderr) whatever the verbosity, and a Python user sees them by enabling the
`mlx_delegate.progress` logger at INFO.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator

log = logging.getLogger("mlx_delegate.progress")


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Logs `name...` on entry and `name: <seconds> s` when it ends."""
    log.info("%s...", name)
    start = time.perf_counter()
    yield
    log.info("%s: %.1f s", name, time.perf_counter() - start)
