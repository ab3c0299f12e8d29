"""Quantized weights and KV scales: formats, quantizers, quantized linear and expert matmuls."""
