"""The offline engine: SGLang's `Engine.generate` API over the scheduler, in this process."""

import gc
import weakref

from tqdm.auto import tqdm

from jaxrunner.batch.input_embeds import EmbedOverride, make_override, split_prompts
from jaxrunner.batch.schedule_batch import Req
from jaxrunner.config import EngineArgs
from jaxrunner.dllm.scheduler import DllmScheduler
from jaxrunner.dp_attention.scheduler import DataParallelScheduler
from jaxrunner.dp_attention.worker import DataParallelWorker
from jaxrunner.engine.lifecycle import EngineLifecycle, EngineNotReadyError
from jaxrunner.engine.output import Logprobs, generate_answer, meta_info
from jaxrunner.engine.request_factory import RequestFactory
from jaxrunner.engine.tokenizer import load_tokenizer
from jaxrunner.pooling.output import pooled_output
from jaxrunner.runner.compile_guard import CompileMonitor
from jaxrunner.sampling.grammar import GrammarCache
from jaxrunner.scheduler.decode import PlainDecode
from jaxrunner.scheduler.scheduler import Scheduler
from jaxrunner.speculative.round import SpeculativeRound
from jaxrunner.speculative.spec_worker import SpeculativeWorker
from jaxrunner.worker.model_worker import ModelWorker
from models.config import ModelConfig


# Engines between start-up and shutdown: start-up freezes the process's objects for the cyclic
# collector (gc.freeze), so a shut-down engine's cycles (its runner, executables and KV cache)
# would never be freed: 2,100 memory maps of compiled code per tiny engine, until a process that
# started ~30 engines hit the kernel's 65,530 and crashed in the next compile.
_LIVE_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def _collect_frozen(engine: "Engine", held: list) -> None:
    """Frees what a shut-down `engine` held. `held`: weak references to its worker and runner
    (what holds its executables, weights and KV cache), after the engine let go of them. Freed
    already (nothing but the engine referred to them), no collection is needed: the frozen
    objects are let go when no engine serves (the collector takes its time, ~1 s beside torch
    and transformers). Else, held in a cycle: everything is unfrozen and collected, and what the
    engines still serving hold frozen again."""
    _LIVE_ENGINES.discard(engine)
    if all(ref() is None for ref in held):
        if not _LIVE_ENGINES:
            gc.unfreeze()
        return
    gc.unfreeze()
    gc.collect()
    if _LIVE_ENGINES:
        gc.freeze()


def create_worker(args: EngineArgs, model_config: ModelConfig,
                  compile_monitor: CompileMonitor | None = None):
    """The worker an engine runs: a ModelWorker, or with speculative_algorithm the speculative
    worker around one."""
    if args.speculative_algorithm is not None:
        return SpeculativeWorker(args, model_config, compile_monitor)
    return ModelWorker(args, model_config, compile_monitor)


class Engine(EngineLifecycle):
    """Loads a Hugging Face checkpoint, compiles every bucket, and generates.

    ```python
    engine = Engine(model_path="hf_dir", dtype="float32", page_size=16)
    outs = engine.generate(input_ids=[[1, 2, 3], [4, 5]],
                           sampling_params={"max_new_tokens": 8, "temperature": 0.0})
    engine.shutdown()
    ```
    Arguments are the fields of `EngineArgs`; `engine.args` holds them with every limit left
    out resolved for this machine (jaxrunner/defaults.py). Memory release and weight updates
    for RL rollouts: `EngineLifecycle` (jaxrunner/engine/lifecycle.py). A server drives it
    through `ServingEngine` (jaxrunner/engine/base.py).
    """

    # The contract's facts (jaxrunner/engine/base.py), set at start-up.
    args: EngineArgs
    model_config: ModelConfig
    tokenizer: object
    weight_version: str

    def __init__(self, **kwargs):
        # What the process holds before start-up is frozen first, so the collection that ends
        # start-up walks only what start-up made (a full one walked the caller's whole heap
        # too: ~0.9 s per engine beside torch and transformers). The caller's cycles from
        # before are unfrozen again when no engine serves (`_collect_frozen`).
        gc.freeze()
        try:
            self._start(EngineArgs.from_kwargs(**kwargs))
        except BaseException:
            if not _LIVE_ENGINES:
                gc.unfreeze()
            raise

    def _start(self, args: EngineArgs) -> None:
        self.model_config = ModelConfig.from_pretrained(args.model_path)
        if args.is_embedding:
            self.model_config = self.model_config.as_embedding()
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
        self.compile_monitor = CompileMonitor()
        # Start-up compiles are this engine's own: another warm engine in the process lets them be.
        with self.compile_monitor.owning():
            self.worker = create_worker(args, self.model_config, self.compile_monitor)
        self.args = self.worker.args
        if self.args.disallow_compile_after_warmup:
            self.compile_monitor.forbid()
        decode_text = self._decode if self.tokenizer else None
        if self.args.dp_size > 1:
            self.scheduler = DataParallelScheduler(DataParallelWorker(self.worker), decode_text)
        elif self.args.dllm_algorithm is not None:
            self.scheduler = DllmScheduler(self.worker, decode_text)
        else:
            decode = (PlainDecode() if self.args.speculative_algorithm is None
                      else SpeculativeRound(self.args.speculative_window))
            self.scheduler = Scheduler(self.worker, decode_text, decode=decode)
        self.weight_version = self.args.weight_version
        cfg = self.model_config
        self.grammar_cache = None if self.tokenizer is None else GrammarCache(
            self.tokenizer, cfg.vocab_size, cfg.eos_token_ids,
            json_whitespace_pattern=self.args.constrained_json_whitespace_pattern,
            json_disable_any_whitespace=self.args.constrained_json_disable_any_whitespace)
        # Validation, ids and seeds of every request (the server's too).
        self.request_factory = RequestFactory(cfg.vocab_size, cfg.eos_token_ids, self.max_req_len,
                                              self.grammar_cache, self.tokenizer is not None,
                                              self.args.random_seed,
                                              speculative=self.args.speculative_algorithm,
                                              check=self.scheduler.check_request,
                                              model_config=cfg,
                                              hidden_states=self.args.enable_return_hidden_states)
        # pause_generation: no step runs until continue_generation.
        self._paused = False
        # Start-up objects (model, executables, tokenizer) live as long as the engine: freezing
        # them keeps the cyclic GC's full collections, which pause a step for ~0.3 s here, short.
        # The collection walks only start-up's objects (the rest is frozen) and frees its garbage.
        gc.collect()
        gc.freeze()
        _LIVE_ENGINES.add(self)

    @property
    def runner(self):
        """The worker's ModelRunner (tests and tools read its facts)."""
        return self.worker.model_runner

    @property
    def context_len(self) -> int:
        return self.worker.context_len

    @property
    def max_req_len(self) -> int:
        """Longest prompt + output one request may reach: the context, or the whole KV cache
        when that is smaller (so a lone request can always finish)."""
        return min(self.context_len, self.worker.max_total_tokens)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- requests ----

    def generate(self, prompt=None, sampling_params=None, input_ids=None,
                 return_logprob: bool | list[bool] = False, priority: int | list[int] = 0,
                 top_logprobs_num: int | list[int] = 0, logprob_start_len: int | list[int] = -1,
                 show_progress: bool = False, input_embeds=None, replace_embeds=None,
                 replace_positions=None, lora_path: str | list[str | None] | None = None,
                 return_hidden_states: bool = False):
        """Generates for one prompt (a dict back) or a list of prompts (a list of dicts back).

        `prompt` is text (or a list of texts), `input_ids` token ids (or a list of lists),
        `input_embeds` a prompt as embeddings [tokens, hidden_size] (or a list of them); give
        one, or `input_ids` and `input_embeds` as two lists with one prompt per request (None in
        the other). `replace_embeds` [k, hidden_size] replace the embeddings of the prompt
        positions `replace_positions` (k ints), per request (lists, None for none), as
        multimodal models place image features. `sampling_params` is a dict of
        `SamplingParams` fields, or a list of dicts, one per request; its `n` > 1 gives that
        many samples of the prompt, one after another in the output list. `return_logprob`
        adds log-probabilities of the output tokens, with `top_logprobs_num` alternatives each,
        and of the prompt from `logprob_start_len` (-1: none), as SGLang's `/generate` does.
        Every request is validated before any runs: a bad one raises ValueError naming it, and
        nothing is enqueued; while the memory is released it raises EngineNotReadyError.
        `show_progress` draws a progress bar of finished requests. `lora_path` names the LoRA
        adapter each request runs with (SGLang's: a name from `lora_paths` or
        `load_lora_adapter`; None: the base model), one for all or a list.
        `return_hidden_states` (with `enable_return_hidden_states`): meta_info["hidden_states"],
        the prompt tokens' states after the final norm, then one per generated token read.
        """
        self._check_serving()
        self._check_generating()
        single, prompts, embeds = self._normalize_prompts(prompt, input_ids, input_embeds)
        n = len(prompts)
        per_request = [self._per_request(v, n, name, default) for v, name, default in (
            (sampling_params, "sampling_params", {}), (return_logprob, "return_logprob", False),
            (priority, "priority", 0), (top_logprobs_num, "top_logprobs_num", 0),
            (logprob_start_len, "logprob_start_len", -1),
            (replace_embeds if not single else [replace_embeds], "replace_embeds", None),
            (replace_positions if not single else [replace_positions], "replace_positions",
             None), (lora_path, "lora_path", None))]
        reqs = []
        for i, (ids, p, lp, prio, top, start, replaced, positions, lora) in enumerate(
                zip(prompts, *per_request)):
            try:
                override = self._override(len(ids), embeds[i], replaced, positions)
                group = self.request_factory.make_group(
                    ids, p, return_logprob=lp, priority=prio, top_logprobs_num=top,
                    logprob_start_len=start, embed_override=override,
                    lora=self.lora_adapter(lora), return_hidden_states=return_hidden_states)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
            reqs += group
        return self._run(reqs, single and len(reqs) == 1, show_progress)

    def encode(self, prompt=None, input_ids=None, dimensions: int | None = None,
               priority: int = 0):
        """A pooling model's results (SGLang's `Engine.encode`): for one prompt a dict, for a
        list of prompts a list of dicts, `{"embedding", "meta_info"}`. An embedding model's
        `embedding` is the pooled vector (normalised if the model normalises; `dimensions`:
        its first entries, Matryoshka truncation, normalised again), a classification or
        reward model's its label scores (logits). `prompt` is text or a list of texts,
        `input_ids` token ids or a list of lists."""
        self._check_serving()
        if self.model_config.is_generation:
            raise ValueError(f"encode needs an embedding or classification model; "
                             f"{self.model_config.architecture} generates (use generate, or "
                             f"start the engine with is_embedding)")
        single, prompts = self._token_prompts(prompt, input_ids)
        reqs = []
        for i, ids in enumerate(prompts):
            try:
                reqs.append(self.request_factory.make(ids, priority=priority,
                                                      dimensions=dimensions))
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        return self._run(reqs, single, False)

    classify = encode  # SGLang's reward-model route's name: the same results

    def _run(self, reqs: list[Req], single: bool, show_progress: bool):
        """Queues `reqs`, steps until they finish, and returns their outputs."""
        if self._paused:
            raise ValueError("generation is paused (pause_generation); continue_generation "
                             "first")
        for req in reqs:
            self.scheduler.add_request(req)
        progress = tqdm(total=len(reqs), desc="generating", disable=not show_progress)
        while not all(r.finished for r in reqs):
            progress.update(sum(r.finished for r in self.scheduler.step()))
        progress.close()
        outputs = [self.output(r) for r in reqs]
        return outputs[0] if single else outputs

    def add_request(self, input_ids: list[int] | None, sampling_params=None,
                    return_logprob: bool = False, priority: int = 0, input_embeds=None,
                    replace_embeds=None, replace_positions=None, **logprob_options) -> Req:
        """Queues one request without running it (the low-level API under `generate`; the
        prompt is `input_ids` or `input_embeds`, as there); `logprob_options`:
        `top_logprobs_num`, `logprob_start_len`.

        Raises ValueError, naming the problem, for a request that cannot be served, and
        EngineNotReadyError while the memory is released.
        """
        self._check_serving()
        if input_embeds is not None:
            _, (ids,), (embeds,) = split_prompts(None if input_ids is None else [input_ids],
                                                 [input_embeds])
        else:
            ids, embeds = list(input_ids), None
        override = self._override(len(ids), embeds, replace_embeds, replace_positions)
        req = self.make_request(ids, sampling_params, return_logprob=return_logprob,
                                priority=priority, embed_override=override, **logprob_options)
        self.enqueue(req)
        return req

    def make_request(self, input_ids: list[int], sampling_params=None, input_embeds=None,
                     **options) -> Req:
        """A validated request (grammar compiled, id and seed drawn), not queued; thread-safe,
        so a server makes them off the thread that steps the engine. `input_embeds`: the
        prompt as embeddings (`input_ids` then placeholders of its length); `options` are
        `RequestFactory.make`'s, with `lora_path` (an adapter's name) for its `lora`."""
        self._check_serving()
        if "lora_path" in options:
            options["lora"] = self.lora_adapter(options.pop("lora_path"))
        if input_embeds is not None:
            options["embed_override"] = self._override(len(input_ids), input_embeds, None, None)
        return self.request_factory.make(input_ids, sampling_params, **options)

    def enqueue(self, req: Req) -> None:
        """Queues a request from `make_request`."""
        self._check_serving()
        self.scheduler.add_request(req)

    def step(self) -> list[Req]:
        """Runs one scheduler step; returns the requests that got a new token in it (check
        `req.finished`). Not thread-safe: drive the engine from one thread."""
        return self.scheduler.step()

    def abort_request(self, req: Req) -> None:
        """Stops a queued or running request and frees its KV pages at once."""
        self.scheduler.abort_request(req)

    @property
    def has_unfinished_requests(self) -> bool:
        """Whether `step` has work: requests in the engine, and generation not paused."""
        return self.scheduler.has_work and not self._paused

    def pause_generation(self, mode: str = "abort") -> None:
        """Stops stepping until `continue_generation` (SGLang's, for RL weight syncs):
        "abort" first ends every request in the engine (finish_reason abort), "in_place"
        keeps them, their KV held, to go on where they stopped. Requests queued meanwhile wait.
        SGLang's "retract" mode is not implemented (ValueError)."""
        if mode not in ("abort", "in_place"):
            raise ValueError(f"pause_generation mode {mode!r} is not implemented (abort or "
                             f"in_place)")
        if mode == "abort":
            for req in self.unfinished_requests():
                self.scheduler.abort_request(req, "aborted by pause_generation")
        self._paused = True

    def continue_generation(self) -> None:
        """Steps again after `pause_generation`."""
        self._paused = False

    def _normalize_prompts(self, prompt, input_ids, input_embeds
                           ) -> tuple[bool, list[list[int]], list]:
        """(single, token ids per request, given embeddings per request or None)."""
        if input_embeds is not None:
            if prompt is not None:
                raise ValueError("give prompt or input_embeds, not both")
            return split_prompts(input_ids, input_embeds)
        single, prompts = self._token_prompts(prompt, input_ids)
        return single, prompts, [None] * len(prompts)

    def _token_prompts(self, prompt, input_ids) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt, input_ids and input_embeds")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set)")
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise ValueError(f"request {i}: prompt must be a string, got "
                                     f"{type(text).__name__}")
                if not text:
                    raise ValueError(f"request {i}: empty prompt")
            return single, [self.tokenizer.encode(t) for t in texts]
        if len(input_ids) == 0:
            raise ValueError("input_ids is empty")
        single = not isinstance(input_ids[0], (list, tuple))
        return single, [list(input_ids)] if single else [list(ids) for ids in input_ids]

    @staticmethod
    def _per_request(value, n: int, name: str, default):
        if value is None:
            value = default
        if isinstance(value, list):
            if len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries for {n} requests")
            return value
        return [value] * n

    def _override(self, prompt_len: int, input_embeds, replace_embeds,
                  replace_positions) -> EmbedOverride | None:
        """The request's given embeddings, checked: a whole prompt or some positions."""
        if (replace_embeds is None) != (replace_positions is None):
            raise ValueError("give replace_embeds and replace_positions together")
        if (input_embeds is not None or replace_embeds is not None) and (
                self.args.speculative_algorithm is not None):
            raise ValueError("input_embeds / replace_embeds are not implemented with "
                             "speculative decoding (the draft would not see them)")
        if input_embeds is not None:
            if replace_embeds is not None:
                raise ValueError("a prompt given as input_embeds has no replace_embeds")
            return make_override(input_embeds, range(prompt_len), prompt_len,
                                 self.model_config.hidden_size)
        if replace_embeds is None:
            return None
        return make_override(replace_embeds, replace_positions, prompt_len,
                             self.model_config.hidden_size)

    def _check_serving(self) -> None:
        blocker = self.runner.serving_blocker()
        if blocker is not None:
            raise EngineNotReadyError(f"cannot take requests: {blocker}")

    def _check_generating(self) -> None:
        if not self.model_config.is_generation:
            raise ValueError(f"this is a pooling model ({self.model_config.head} head of "
                             f"{self.model_config.architecture}): it generates nothing; use "
                             f"encode")

    def output(self, req: Req) -> dict:
        """The answer of a finished request: SGLang's `/generate` dict
        (jaxrunner/engine/output.py)."""
        spec_verify_ct = (req.spec_verify_ct if self.args.speculative_algorithm is not None
                          else None)
        meta = meta_info(req.rid, req.origin_input_ids, req.output_ids, req.finished_reason,
                         cached_tokens=req.cached_tokens, weight_version=self.weight_version,
                         logprobs=Logprobs.of(req) if req.return_logprob else None,
                         spec_verify_ct=spec_verify_ct)
        if req.pooling is not None:
            return {"embedding": pooled_output(req), "meta_info": meta}
        if req.return_hidden_states:
            meta["hidden_states"] = req.hidden_states
        text = None
        if self.tokenizer is not None:
            text = (req.stopped_text if req.stopped_text is not None
                    else self._decode(req.output_ids))
        return generate_answer(req.output_ids, meta, text)

    # ---- lifecycle ----

    def memory_stats(self) -> dict:
        """KV pages and request slots, summed over DP ranks, and the waiting requests
        (`SchedulerContract.memory_stats`). `kv_pages_free` counts cached prefixes no request
        holds: they are evicted on demand."""
        return self.scheduler.memory_stats()

    # ---- LoRA adapters ----

    @property
    def lora_registry(self):
        """The adapters and their device slots (jaxrunner/lora/registry.py); None without
        LoRA."""
        return self.worker.lora_registry  # a speculative worker has none

    def lora_adapter(self, name: str | None):
        """The loaded adapter `name` (None: the base model); ValueError naming an unknown one,
        or LoRA not enabled."""
        if name is None:
            return None
        if self.lora_registry is None:
            raise ValueError(f"lora_path {name!r} given, but this engine serves no LoRA adapters "
                             f"(start it with enable_lora or lora_paths)")
        return self.lora_registry.get(name)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """Loads the PEFT adapter at `lora_path` under `lora_name` while serving (SGLang's
        name): into host memory now, into a device slot when a request first needs it; compiles
        nothing. Raises ValueError naming the problem (the name taken, a bad file, a rank or
        module the engine's pool lacks)."""
        if self.lora_registry is None:
            raise ValueError("load_lora_adapter needs an engine started with enable_lora")
        self.lora_registry.load(lora_name, lora_path)
        return {"success": True, "loaded_adapters": self.loaded_lora_adapters()}

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Forgets adapter `lora_name`; refused (ValueError) while a request uses it."""
        adapter = self.lora_adapter(lora_name)
        users = [r for r in self.unfinished_requests() if r.lora is adapter]
        if users:
            raise ValueError(f"LoRA adapter {lora_name!r} is in use by {len(users)} unfinished "
                             f"requests")
        self.lora_registry.unload(lora_name)
        return {"success": True, "loaded_adapters": self.loaded_lora_adapters()}

    def loaded_lora_adapters(self) -> dict[str, str]:
        """{name: path} of every loaded adapter."""
        registry = self.lora_registry
        return {} if registry is None else {n: a.path for n, a in registry.adapters.items()}

    # ---- mixture of experts ----

    def _expert_tools(self):
        if self.args.speculative_algorithm is not None:
            raise ValueError("expert distribution recording and EPLB are not implemented with "
                             "speculative decoding (verify steps do not keep routed counts)")
        if self.worker.expert_recorder is None:
            raise ValueError(f"{self.model_config.architecture} has no experts: expert "
                             f"distribution recording and EPLB need a MoE model")
        return self.worker.expert_recorder, self.worker.eplb_manager

    def start_expert_distribution_record(self) -> None:
        """Starts recording routed-token counts per (MoE layer, expert slot) (SGLang's name);
        compiles nothing."""
        self._expert_tools()[0].start()

    def stop_expert_distribution_record(self) -> None:
        self._expert_tools()[0].stop()

    def dump_expert_distribution_record(self, path: str | None = None) -> dict:
        """The recording as a dict (`expert_distribution_recorder_mode` "stat": counts summed,
        "per_pass": per forward pass; physical slots and logical experts), also written as JSON
        to `path` or a new file in `expert_distribution_recorder_dir` (the dict's "path")."""
        return self._expert_tools()[0].dump(path)

    def rebalance_experts(self) -> dict:
        """Rebalances the experts over their slots and EP ranks now (EPLB) from the routed
        counts since the last rebalance, moving expert weights between devices; compiles
        nothing. Returns what it did (balancedness = mean / max load per rank)."""
        return self._expert_tools()[1].rebalance()

    def flush_cache(self) -> bool:
        """Empties the prefix cache; refused (False) while requests are in the engine."""
        return self.scheduler.flush_cache()

    def unfinished_requests(self) -> list[Req]:
        """Every request waiting, being prefilled or decoding, on every DP rank."""
        return self.scheduler.unfinished_requests()

    def shutdown(self) -> None:
        self.compile_monitor.close()
        held = [] if self.worker is None else [weakref.ref(self.worker),
                                               weakref.ref(self.worker.model_runner)]
        # Everything that reaches the runner goes (the request factory checks requests with
        # the scheduler), so that it is freed while the caller still holds this engine.
        self.worker = None
        self.scheduler = None
        self.request_factory = None
        _collect_frozen(self, held)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

