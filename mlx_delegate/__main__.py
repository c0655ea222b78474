"""`python -m mlx_delegate ...`: the same command line as `mlx-delegate`."""

import sys

from .cli import main

sys.exit(main())
