"""Multi-LoRA serving: PEFT adapters read to host memory (adapter.py), the device slots they
occupy with pins and LRU eviction (registry.py), the device pool and its slot-writing program
(pool.py), and the per-token low-rank update in the model (layers.py)."""
