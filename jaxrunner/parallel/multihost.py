"""Joining the processes of a multi-host run (`nnodes` > 1) into one JAX program.

After `initialize`, `jax.devices()` lists every process's devices and the engine's mesh spans
them all; the host-side lock-step of the processes is `jaxrunner/engine/lockstep.py`.
"""

import jax

from jaxrunner.config import EngineArgs


def initialize(args: EngineArgs) -> None:
    """Joins the `args.nnodes` processes (no-op for one). Call before anything touches a device.

    On CPU the processes exchange collectives over gloo (tests: two local processes).
    """
    if args.nnodes == 1 or jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.dist_init_addr,
                               num_processes=args.nnodes, process_id=args.node_rank)
