"""DP attention on one host: each data-parallel rank schedules its own requests and KV pages; all ranks run one SPMD step."""
