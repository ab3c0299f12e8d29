"""Building blocks shared by the model families: RoPE, the MoE layer and its parallel runner, packed CPU linear weights."""
