"""Fused multi-node patterns (SDPA, RoPE, RMSNorm, KV-cache update, quantized linear)."""
