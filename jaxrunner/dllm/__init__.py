"""Block-diffusion language models (SDAR; SGLang's `dllm_algorithm`): DLLM_EXTEND steps and
their scheduler. See `scheduler.py` for how a request moves through its blocks."""
