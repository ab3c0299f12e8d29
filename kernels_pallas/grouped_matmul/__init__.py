"""Grouped matmul for MoE experts: rows sorted by group, each times its group's weight.

On TPUs `jax.lax.ragged_dot` is this (XLA:TPU lowers it to the routed work); on GPUs it is the
Pallas kernel of `gpu.py`; `reference.py` is the tests' pure-jnp form.
"""

from kernels_pallas.grouped_matmul.gpu import check_supported, grouped_matmul_gpu
from kernels_pallas.grouped_matmul.reference import grouped_matmul_reference

__all__ = ["check_supported", "grouped_matmul_gpu", "grouped_matmul_reference"]
