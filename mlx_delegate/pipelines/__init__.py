"""Pipelines built on the delegate: lowering a model's methods, caching the lowered
program, and the runners that drive it (speech transcription, LLM generation).

Architectures (what is exported) live in `mlx_delegate.models`; this package holds
what is done with them.
"""
