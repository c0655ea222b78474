"""LLM export and generation on the MLX delegate (Llama family)."""
