"""The ExecuTorch `BackendDetails` for mlx_delegate."""

from .preprocess import BACKEND_ID, MLXDelegateBackend

__all__ = ["BACKEND_ID", "MLXDelegateBackend"]
