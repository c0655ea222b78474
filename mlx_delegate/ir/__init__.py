"""Typed Python view of the IR schema (built from schema/mlx_delegate.fbs)."""
