"""An engine whose output is scripted: the server's routes and output parsers run as they do on
a real engine (a real tokenizer, the engine loop, the chat template), but every request
generates the token ids a test set (`engine.script`), one per step, and no model runs. For what
random weights cannot show: that a given output is read right.

The finish rules are the engine's where a script reaches them: a stop (EOS) token ends a request
and stays in its output, `max_new_tokens` ends it with "length".
"""

import dataclasses
import types


@dataclasses.dataclass(eq=False)
class ScriptedReq:
    """The fields of `Req` the server reads."""

    origin_input_ids: list
    max_new_tokens: int
    script: list
    return_logprob: bool = False
    output_ids: list = dataclasses.field(default_factory=list)
    output_logprobs: list = dataclasses.field(default_factory=list)
    top_logprobs_num: int = 0
    output_top_logprobs: list = dataclasses.field(default_factory=list)
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None
    input_logprobs_done: bool = False
    hidden_states: list = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    spec_verify_ct: int = 0
    finished_reason: dict | None = None
    stopped_text: str | None = None

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None


class ScriptedEngine:
    """The serving contract's request verbs over scripted outputs. `script`: the token ids every
    request generates (set it before each request); `eos_token_ids`: the tokens that end one."""

    weight_version = "default"
    context_len = 4096

    def __init__(self, tokenizer, architecture: str, eos_token_ids=()):
        self.tokenizer = tokenizer
        self.model_config = types.SimpleNamespace(architecture=architecture, is_generation=True)
        self.args = types.SimpleNamespace(max_queued_requests=None, request_timeout=None)
        self.eos_token_ids = set(eos_token_ids)
        self.script: list[int] = []
        self.prompts: list[list[int]] = []   # every request's prompt, in arrival order
        self.reqs: list[ScriptedReq] = []

    def make_request(self, input_ids, sampling_params=None, return_logprob=False, **options):
        params = sampling_params or {}
        return ScriptedReq(list(input_ids), params.get("max_new_tokens") or self.context_len,
                           list(self.script), return_logprob)

    def enqueue(self, req: ScriptedReq) -> None:
        self.prompts.append(req.origin_input_ids)
        self.reqs.append(req)

    def add_request(self, input_ids, sampling_params=None, return_logprob=False, **options):
        req = self.make_request(input_ids, sampling_params, return_logprob)
        self.enqueue(req)
        return req

    @property
    def has_unfinished_requests(self) -> bool:
        return any(not r.finished for r in self.reqs)

    def step(self) -> list[ScriptedReq]:
        live = [r for r in self.reqs if not r.finished]
        for r in live:
            token = r.script[len(r.output_ids)]
            r.output_ids.append(token)
            if token in self.eos_token_ids:
                r.finished_reason = {"type": "stop", "matched": token}
            elif len(r.output_ids) >= r.max_new_tokens:
                r.finished_reason = {"type": "length", "length": r.max_new_tokens}
            elif len(r.output_ids) == len(r.script):
                r.finished_reason = {"type": "stop", "matched": None}
        self.reqs = [r for r in self.reqs if not r.finished]
        return live

    def abort_request(self, req: ScriptedReq) -> None:
        if not req.finished:
            req.finished_reason = {"type": "abort"}

    def memory_stats(self) -> dict:
        return {"kv_pages_total": 10, "kv_pages_free": 10, "kv_pages_cached": 0,
                "req_slots_total": 4, "req_slots_free": 4, "num_requests_waiting": 0}

    def loaded_lora_adapters(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass
