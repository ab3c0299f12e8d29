"""The batch types of one step, host to device: `ForwardMode`, the buckets every batch pads to, `Req` / `ScheduleBatch` / `ModelWorkerBatch` (host, no jax) and `ForwardBatch` (the device pytree)."""
