"""mlx_delegate: run exported PyTorch programs on MLX through ExecuTorch.

Importing the package registers the backend with the executorch wheel's
runtime, so `executorch.runtime.Runtime` can run programs lowered with
`MLXPartitioner`.
"""

import warnings

from . import _quiet

_quiet.install()  # before anything below imports executorch (and through it torchao)

from . import _blas  # noqa: E402

_blas.install()  # must run before libmlx.so is loaded (by _runtime below)

# The executorch Python binding installs its log sink when it loads; _runtime
# wraps that sink (payload bytes in log lines would abort the binding), so the
# binding must be loaded first (quietly: its import warns that the API is experimental).
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import executorch.extension.pybindings.portable_lib  # noqa: E402,F401

from . import _runtime  # noqa: E402,F401  (registers the C++ backend on import)
from . import compat  # noqa: E402

compat.apply()

from .backend import BACKEND_ID, MLXDelegateBackend  # noqa: E402
from .errors import LoweringError, Unsupported  # noqa: E402
from .partitioner import MLXPartitioner  # noqa: E402

__all__ = ["BACKEND_ID", "LoweringError", "MLXDelegateBackend", "MLXPartitioner", "Unsupported"]
__version__ = "0.1.0"
