"""KV memory: the host's page allocator and request -> pages table, the device's paged KV cache, and the radix prefix cache."""
