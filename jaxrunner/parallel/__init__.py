"""The device mesh (`data`, `tensor`) and the shardings the engine reuses."""
