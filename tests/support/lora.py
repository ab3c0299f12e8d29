"""Multi-LoRA tests' adapters, prompts and reference: PEFT's own generate on adapters PEFT wrote."""

from peft import PeftModel
import torch
from transformers import AutoModelForCausalLM

from tests.support.parity import prompts_of_lengths

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTN + ["gate_proj", "up_proj", "down_proj"]
# 16 ragged prompts, some past a page (LORA_ENGINE holds them all at once).
LORA_PROMPT_LENS = [1, 3, 17, 5, 9, 2, 20, 4, 6, 8, 11, 7, 3, 12, 5, 10]
MAX_NEW = 8


def lora_prompts(vocab: int, lens=LORA_PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    """Random prompts of `lens` tokens (by default the 16 of LORA_PROMPT_LENS)."""
    return prompts_of_lengths(vocab, lens, seed)


class PeftReference:
    """Greedy tokens of PEFT's generate, per adapter name (None: the base model)."""

    def __init__(self, base, adapters: dict):
        hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        names = list(adapters)
        self.model = PeftModel.from_pretrained(hf, str(adapters[names[0]]),
                                               adapter_name=names[0])
        for name in names[1:]:
            self.model.load_adapter(str(adapters[name]), adapter_name=name)
        self._cache = {}

    def generate(self, prompt, adapter, max_new=MAX_NEW):
        """`prompt`'s greedy continuation under `adapter` (cached per prompt and adapter)."""
        key = (tuple(prompt), adapter, max_new)
        if key not in self._cache:
            self._cache[key] = self._generate(prompt, adapter, max_new)
        return self._cache[key]

    def _generate(self, prompt, adapter, max_new):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            if adapter is None:
                with self.model.disable_adapter():
                    out = self.model.generate(input_ids=ids, max_new_tokens=max_new,
                                              do_sample=False)
            else:
                self.model.set_adapter(adapter)
                out = self.model.generate(input_ids=ids, max_new_tokens=max_new, do_sample=False)
        return out[0, len(prompt):].tolist()


def check_against_peft(engine, ref: PeftReference, prompts, adapters):
    """One mixed batch of `prompts`, each under its adapter name (None: the base model), gives
    PEFT's greedy tokens; returns the engine's outputs."""
    outs = engine.generate(input_ids=prompts, lora_path=adapters,
                           sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0.0})
    for i, (prompt, name, out) in enumerate(zip(prompts, adapters, outs)):
        assert out["output_ids"] == ref.generate(prompt, name), \
            f"request {i} ({len(prompt)} tokens, adapter {name})"
    return outs
