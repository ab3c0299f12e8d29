"""The device slots of the LoRA adapters admitted requests run with (host only, no jax): a request
pins its adapter's slot from admission until its KV is released (jaxrunner/lora/registry.py
copies an adapter into a slot when it is not resident)."""

from jaxrunner.batch.schedule_batch import Req


def acquire_lora_slot(registry, req: Req) -> bool:
    """Pins a slot holding the request's adapter; False when every slot is pinned by other
    adapters' requests (the request waits). Base-model requests need none. `registry`: the
    worker's `lora_registry` (None without LoRA, where no request names an adapter)."""
    if req.lora is None:
        return True
    slot = registry.acquire(req.lora)
    if slot is None:
        return False
    req.lora_slot = slot
    return True


def release_lora_slot(registry, req: Req) -> None:
    """Unpins the request's slot, if it holds one."""
    if req.lora_slot >= 0:
        registry.release(req.lora_slot)
        req.lora_slot = -1
