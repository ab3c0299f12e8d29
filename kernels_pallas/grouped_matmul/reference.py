"""The grouped matmul in plain jnp: each row times its own group's weight, rows past the
groups 0. The kernels' reference, no serving path (it gathers a [K, N] weight per row)."""

import jax.numpy as jnp


def grouped_matmul_reference(xs, w, group_sizes, *, scale=None, bias=None):
    """As `grouped_matmul_gpu`, with rows past sum(group_sizes) 0."""
    M = xs.shape[0]
    G = w.shape[0]
    group = jnp.repeat(jnp.arange(G), group_sizes, total_repeat_length=M)
    in_group = jnp.arange(M) < jnp.sum(group_sizes)
    y = jnp.einsum("mk,mkn->mn", xs.astype(jnp.float32), w[group].astype(jnp.float32))
    if scale is not None:
        y = y * scale.astype(jnp.float32).reshape(G, -1)[group]
    if bias is not None:
        y = y + bias.astype(jnp.float32).reshape(G, -1)[group]
    return jnp.where(in_group[:, None], y, 0).astype(xs.dtype)
