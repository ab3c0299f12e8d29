"""The engine contract: what the HTTP server (jaxrunner/server/, jaxrunner/cli.py) calls on the
engine it serves, and nothing more.

Two classes implement it: `Engine` (one process) and `LockstepEngine` (a multi-host run's leader,
which sends every call that changes the engine's state to the other hosts too, so they never
drift). The server is typed against `ServingEngine` and reaches no other attribute;
tests/engine/test_contract.py checks both classes and every `engine.<name>` in the server.
"""

from typing import Protocol

from jaxrunner.batch.schedule_batch import Req
from jaxrunner.config import EngineArgs
from models.config import ModelConfig


class EngineDeadError(RuntimeError):
    """The engine can serve no more (a host of a multi-host run diverged from the others); the
    server must stop rather than answer from it."""


class ServingEngine(Protocol):
    """An engine a server can drive from one thread (`step`), with its lifecycle verbs (SGLang's
    names and semantics: jaxrunner/engine/lifecycle.py)."""

    # ---- facts fixed at start-up ----

    args: EngineArgs               # resolved for this machine
    model_config: ModelConfig
    tokenizer: object              # a Hugging Face tokenizer, None with skip_tokenizer_init

    @property
    def context_len(self) -> int: ...

    weight_version: str            # of the weights loaded now

    # ---- requests: one thread ----

    def make_request(self, input_ids: list[int], sampling_params=None, input_embeds=None,
                     **options) -> Req:
        """A validated request, not queued; thread-safe."""

    def enqueue(self, req: Req) -> None:
        """Queues a request from `make_request`."""

    def add_request(self, input_ids: list[int] | None, sampling_params=None,
                    return_logprob: bool = False, **options) -> Req:
        """`make_request` then `enqueue`."""

    def step(self) -> list[Req]:
        """One scheduler step: the requests that got a token (or finished) in it."""

    def abort_request(self, req: Req) -> None:
        """Stops a queued or running request; its KV pages are freed at once."""

    @property
    def has_unfinished_requests(self) -> bool: ...

    def memory_stats(self) -> dict:
        """KV pages, request slots and waiting requests (jaxrunner/engine/engine.py)."""

    # ---- lifecycle: run between two steps ----

    def flush_cache(self) -> bool:
        """Empties the prefix cache; False while requests are in the engine."""

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False,
                                 weight_version: str | None = None) -> tuple[bool, str]: ...

    def update_weights_from_tensor(self, named_tensors, abort_all_requests: bool = False,
                                   weight_version: str | None = None,
                                   flush_cache: bool = True) -> tuple[bool, str]: ...

    def get_weights_by_name(self, name: str, truncate_size: int = 100): ...

    def release_memory_occupation(self, tags: list[str] | None = None) -> None: ...

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None: ...

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict: ...

    def unload_lora_adapter(self, lora_name: str) -> dict: ...

    def loaded_lora_adapters(self) -> dict[str, str]:
        """{name: path} of every LoRA adapter loaded now."""

    def start_expert_distribution_record(self) -> None: ...

    def stop_expert_distribution_record(self) -> None: ...

    def dump_expert_distribution_record(self, path: str | None = None) -> dict: ...

    def rebalance_experts(self) -> dict:
        """EPLB now: a MoE model's experts placed anew from the routed counts."""

    def pause_generation(self, mode: str = "abort") -> None:
        """No step runs until `continue_generation`; "abort" ends the requests in the engine
        first, "in_place" keeps them (SGLang's)."""

    def continue_generation(self) -> None: ...

    def shutdown(self) -> None: ...
