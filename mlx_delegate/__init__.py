"""mlx_delegate: run exported PyTorch programs on MLX through ExecuTorch.

Importing the package registers the backend with the executorch wheel's
runtime, so `executorch.runtime.Runtime` can run programs lowered with
`MLXPartitioner`.
"""

from . import _runtime  # noqa: F401  (registers the C++ backend on import)
from .backend import BACKEND_ID, MLXDelegateBackend
from .errors import LoweringError, Unsupported
from .partitioner import MLXPartitioner

__all__ = ["BACKEND_ID", "LoweringError", "MLXDelegateBackend", "MLXPartitioner", "Unsupported"]
__version__ = "0.1.0"
