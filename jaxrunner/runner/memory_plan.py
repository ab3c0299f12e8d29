"""The memory plan: how many KV pages, request slots and prefill tokens a run gets.

A pure function of the engine arguments, the model's config, the platform and what the device
offers (`DeviceBytes`: its memory, and the weights' and LoRA slots' bytes per device computed
from abstract shapes before anything is loaded). It runs once, before the runner is built; its
`args` are the engine arguments every layer above reads (`ModelWorker.args`), never rewritten
afterwards. The limits the caller left out are chosen for the platform (jaxrunner/defaults.py)
and capped by the KV capacity:

1. `max_running_requests`, `max_prefill_tokens`: the platform's defaults where None;
2. KV bytes per token per device: the model's KV heads on one device (with multi-head latent
   attention the latent row, whole on every device), plus a speculative draft's (its KV lives
   on the same pages);
3. the KV budget: `max_total_tokens`, or `mem_fraction_static` of the device's memory less the
   weights, the LoRA slots and the request slots' sampling state (on a CPU also at most
   `defaults.CPU_MAX_KV_BYTES`, and no more than every running request at full context); on a
   TPU or GPU also at most what the programs' temporaries leave of the whole memory: the largest
   a compiled program reports (`memory_analysis`, `DeviceBytes.program_temp`), else an estimate
   from the largest prefill bucket's activations (`estimate_program_temp`), plus
   `PROGRAM_MARGIN` of the memory;
4. with a sliding-window pool (`plan_swa`), the budget split between the full layers' pages
   and the windowed layers' (EngineArgs.swa_full_tokens_ratio);
5. pages of `page_size` (and the dummy page 0), then the defaulted limits capped by them
   (`defaults.fit_to_kv`).
"""

import dataclasses
from dataclasses import dataclass

import jax.numpy as jnp

from jaxrunner import defaults
from jaxrunner.attention.mla import latent_cache_width
from jaxrunner.config import EngineArgs
from jaxrunner.mem_cache import kv_cache
from jaxrunner.mem_cache.kv_cache import model_kv_bytes_per_token
from jaxrunner.sampling.penalties import slot_state_bytes
from models.config import ModelConfig
from models.sharding import sharded_model_config


class KvCapacityError(ValueError):
    """The device's memory leaves no room for a KV cache (not a bad argument: a model too large
    for the device)."""


@dataclass(frozen=True)
class DeviceBytes:
    """What the plan reads of the device, per device."""

    # What `mem_fraction_static` is a fraction of: the accelerator's memory, or the host's
    # available memory on a CPU (`device_memory`); None: no device to size the KV cache from
    # (lowering for another platform).
    memory: int | None
    weights: int = 0               # the model's weights
    lora_pool: int = 0             # the LoRA adapter slots
    draft_kv_per_token: int = 0    # a speculative draft's KV bytes per token, on the same pages
    # The largest temporaries of the compiled programs (None: not compiled yet, estimated).
    program_temp: int | None = None


# Of a TPU's or GPU's memory, kept free beside the weights, the KV cache and the largest
# program's temporaries: the runtime's own buffers, the uploads of a step, fragmentation.
PROGRAM_MARGIN = 0.03


@dataclass(frozen=True)
class SwaPlan:
    """A sliding-window KV pool (jaxrunner/mem_cache/swa_memory_pool.py): the layers that read
    it, the window its pages keep, and its pages."""

    windowed: tuple[bool, ...]     # per decoder layer: whether its KV is in this pool
    window: int                    # the largest window of those layers
    num_pages: int                 # per DP rank, the dummy page included
    bytes_per_token: int           # per device: a token's KV in every windowed layer


@dataclass(frozen=True)
class MemoryPlan:
    args: EngineArgs               # max_running_requests and max_prefill_tokens resolved
    context_len: int
    kv_bytes_per_token: int        # per device, a draft's included
    num_pages: int                 # per DP rank, the dummy page included
    max_total_tokens: int          # the pages' tokens, the dummy page's not
    max_pages_per_req: int         # pages of a request at full context
    program_temp: int = 0          # per device: kept aside for the programs' temporaries
    budget: int | None = None      # per device: what the KV cache could take (None: given)
    device: DeviceBytes | None = None  # what the plan read of the device
    latent_width: int | None = None  # a latent KV cache's row width (MLA); None: per-head
    # A sliding-window pool beside the full layers' pages (then `kv_bytes_per_token` counts
    # the full layers and a draft only); None: every layer's KV in one pool.
    swa: SwaPlan | None = None

    @property
    def kv_cache_bytes(self) -> int:
        """The KV cache's bytes per device (every page, the dummy ones included)."""
        ps = self.args.page_size
        swa = 0 if self.swa is None else self.swa.num_pages * ps * self.swa.bytes_per_token
        return self.num_pages * ps * self.kv_bytes_per_token + swa

    @property
    def num_slots(self) -> int:
        """Request slots per DP rank: requests that are prefilling also hold one, so one prefill
        batch fits on top of the running requests."""
        return self.args.max_running_requests + 1


def device_memory(device) -> int:
    """The memory `mem_fraction_static` is a fraction of: the accelerator's, or on a CPU the
    host's available memory."""
    stats = device.memory_stats()  # None on CPU
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"]
    return kv_cache.host_available_bytes()


def kv_cache_dtype(args: EngineArgs, model_config: ModelConfig):
    """The KV cache's dtype: `kv_cache_dtype`, "auto" the model's."""
    return kv_cache.kv_cache_dtype(args.kv_cache_dtype,
                                   jnp.dtype(model_config.resolve_dtype(args.dtype)))


def plan_memory(args: EngineArgs, model_config: ModelConfig, platform: str,
                device: DeviceBytes, attention_backend: str = "auto") -> MemoryPlan:
    """The run's memory plan (see the module's docstring). `model_config`: the checkpoint's,
    quantization resolved; `attention_backend` resolved (the TPU kernel bounds the running
    requests). Raises ValueError when the KV cache cannot hold a page or the chunked prefill
    exceeds the prefill limit it leaves."""
    context_len = args.context_length or model_config.max_position_embeddings
    max_pages_per_req = -(-context_len // args.page_size)
    running = args.max_running_requests or defaults.default_max_running_requests(
        platform, attention_backend, max_pages_per_req)
    prefill = args.max_prefill_tokens or max(defaults.default_max_prefill_tokens(platform),
                                             args.chunked_prefill_size or 0)
    sharded = sharded_model_config(model_config, args.tp_size, args.ep_num_redundant_experts)
    # Per device: each holds its KV heads' slice of every page.
    latent_width = latent_cache_width(sharded, attention_backend, platform,
                                      args.pallas_interpret)
    per_token = model_kv_bytes_per_token(sharded, sharded.num_hidden_layers, args.tp_size,
                                         kv_cache_dtype(args, model_config), latent_width)
    per_token += device.draft_kv_per_token
    max_total_tokens = args.max_total_tokens
    program_temp, budget = 0, None
    if max_total_tokens is None:
        program_temp = _program_temp(args, sharded, platform, device, running, prefill)
        budget = _kv_budget(args, device, running, sharded.vocab_size, program_temp)
        max_total_tokens = _kv_capacity(platform, budget, per_token, running, context_len)
    swa = None
    windowed = windowed_layers(sharded) if args.hybrid_swa_memory_possible else None
    if windowed is not None:
        layer_bytes = model_kv_bytes_per_token(sharded, 1, args.tp_size,
                                               kv_cache_dtype(args, model_config))
        max_total_tokens, swa = plan_swa(args, sharded, windowed, max_total_tokens * per_token,
                                         per_token, layer_bytes, running, prefill)
        per_token -= swa.bytes_per_token
    elif args.swa_full_tokens_ratio is not None:
        raise ValueError(f"swa_full_tokens_ratio sizes a sliding-window KV pool, and "
                         f"{model_config.architecture} has no mix of windowed and full "
                         f"layers to keep one for")
    num_pages = max_total_tokens // args.page_size + 1  # + the dummy page
    if num_pages < 2:
        raise KvCapacityError(f"no memory left for the KV cache ({max_total_tokens} tokens); "
                              f"lower mem_fraction_static's load or pass max_total_tokens")
    max_total_tokens = (num_pages - 1) * args.page_size
    fit_running, fit_prefill = defaults.fit_to_kv(running, prefill, max_total_tokens,
                                                  args.page_size)
    # EngineArgs checks the resolved limits (a chunked prefill within the prefill limit).
    resolved = dataclasses.replace(
        args, max_running_requests=args.max_running_requests or fit_running,
        max_prefill_tokens=args.max_prefill_tokens or fit_prefill)
    return MemoryPlan(resolved, context_len, per_token, num_pages, max_total_tokens,
                      max_pages_per_req, program_temp, budget, device, latent_width, swa)


def windowed_layers(cfg: ModelConfig) -> tuple[bool, ...] | None:
    """Per layer, whether it attends over a window, for a model with both kinds of layer (the
    ones a sliding-window pool serves); None for any other."""
    windowed = tuple(kind.sliding_window is not None for kind in cfg.attention_kinds)
    if cfg.mla is not None or all(windowed) or not any(windowed):
        return None
    return windowed


def plan_swa(args: EngineArgs, sharded: ModelConfig, windowed: tuple[bool, ...],
             budget_bytes: int, per_token: int, layer_bytes: int, running: int,
             prefill: int) -> tuple[int, SwaPlan]:
    """`budget_bytes` split between the full layers' tokens (`per_token` less the windowed
    layers' bytes each) and a sliding-window pool -> (full tokens, the pool). Its tokens are
    `swa_full_tokens_ratio` x the full ones, or by default what every running request's window
    (and a page on each side) and one prefill step take, when the rest leaves the full layers at
    least as many tokens; else as many as the full layers (ratio 1)."""
    ps = args.page_size
    window = max(kind.sliding_window for kind in sharded.attention_kinds
                 if kind.sliding_window is not None)
    swa_per_token = sum(windowed) * layer_bytes
    full_per_token = per_token - swa_per_token
    ratio = args.swa_full_tokens_ratio
    if ratio is None:
        swa_tokens = running * (window + 2 * ps) + prefill + ps
        full = (budget_bytes - swa_tokens * swa_per_token) // full_per_token
        if full >= swa_tokens:
            return full, SwaPlan(windowed, window, swa_tokens // ps + 1, swa_per_token)
        ratio = 1.0
    full = int(budget_bytes // (full_per_token + ratio * swa_per_token))
    swa_tokens = int(full * ratio)
    one_request = (args.chunked_prefill_size or prefill) + window + 2 * ps
    if ratio < 1 and swa_tokens < one_request:
        raise KvCapacityError(
            f"swa_full_tokens_ratio={args.swa_full_tokens_ratio} leaves the sliding-window pool "
            f"{swa_tokens} tokens, fewer than one request's prefill chunk and window take "
            f"({one_request}); raise it")
    return full, SwaPlan(windowed, window, swa_tokens // ps + 1, swa_per_token)


def estimate_program_temp(sharded: ModelConfig, tp_size: int, max_prefill_tokens: int,
                          max_rows: int) -> int:
    """An upper estimate of a step's temporaries before anything is compiled: the largest
    prefill bucket's activations in float32 (the residual stream and norms, q/k/v, the MLP's
    gate, up and product, of one layer at a time: the layers are scanned) and the sampler's
    float32 logits of `max_rows` rows, a few copies of each."""
    heads = (sharded.num_attention_heads + 2 * sharded.num_key_value_heads) // tp_size
    mlp = (sharded.moe_intermediate_size * sharded.num_experts_per_tok if sharded.is_moe
           else sharded.intermediate_size) // tp_size
    per_token = 4 * (4 * sharded.hidden_size + heads * sharded.head_dim + 3 * mlp)
    return max_prefill_tokens * per_token + 4 * max_rows * sharded.vocab_size * 4


def _program_temp(args: EngineArgs, sharded: ModelConfig, platform: str, device: DeviceBytes,
                  running: int, prefill: int) -> int:
    """What a TPU or GPU keeps aside for the programs' temporaries: as compiled, else
    estimated (a CPU's programs take host memory, which its KV budget already leaves alone)."""
    if platform == "cpu" or device.memory is None:
        return 0
    if device.program_temp is not None:
        return device.program_temp
    return estimate_program_temp(sharded, args.tp_size, prefill, running + 1)


def _kv_budget(args: EngineArgs, device: DeviceBytes, running: int, vocab_size: int,
               program_temp: int) -> int:
    """Bytes per device the KV cache may take when `max_total_tokens` is left out."""
    if device.memory is None:
        raise ValueError("the KV cache needs max_total_tokens: there is no device memory to "
                         "size it from")
    # `mem_fraction_static` is the weights' and the KV cache's share, as in SGLang; the rest
    # must still hold the programs' temporaries (on a CPU `program_temp` is 0).
    margin = int(PROGRAM_MARGIN * device.memory) if program_temp else 0
    budget = min(int(device.memory * args.mem_fraction_static),
                 device.memory - program_temp - margin) - device.weights
    # The adapter slots and the request slots' sampling state (jaxrunner/sampling/penalties.py)
    # are taken before the KV cache.
    return budget - device.lora_pool - args.dp_size * slot_state_bytes(running + 1, vocab_size)


def _kv_capacity(platform: str, budget: int, per_token: int, running: int,
                 context_len: int) -> int:
    """The tokens the KV cache may hold in `budget` bytes per device."""
    tokens = budget // per_token
    if platform == "cpu":
        # Host memory is shared with everything else, and more than every running request at
        # full context buys nothing (jaxrunner/defaults.py).
        tokens = min(tokens, defaults.CPU_MAX_KV_BYTES // per_token, running * context_len)
    return tokens
