"""Random LoRA adapters written by PEFT itself (`get_peft_model` + `save_pretrained`), so tests
read the real format: for the random checkpoints of models/testing/random_checkpoint.py.

PEFT initialises B to zero (an adapter that changes nothing); `init_lora_weights=False` draws A
and B at random instead, and `scale` multiplies B so the adapter moves greedy tokens visibly.
Needs torch and peft (the test extra).
"""

from pathlib import Path

from peft import LoraConfig, get_peft_model
import torch
from transformers import AutoModelForCausalLM


def make_lora_adapter(base_path: str | Path, out: str | Path, *, rank: int,
                      target_modules: list[str], alpha: float | None = None,
                      use_rslora: bool = False, seed: int = 0, scale: float = 1.0) -> Path:
    """Writes a random LoRA adapter for the checkpoint at `base_path` to `out` (PEFT's
    adapter_config.json and adapter_model.safetensors); returns `out`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=list(target_modules), use_rslora=use_rslora,
                        lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    peft_model.save_pretrained(str(out))
    return Path(out)
