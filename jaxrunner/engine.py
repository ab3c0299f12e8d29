"""The offline engine: SGLang's `Engine.generate` API over the scheduler, in this process."""

import itertools
import random

from transformers import AutoTokenizer

from jaxrunner.compile_guard import CompileMonitor
from jaxrunner.config import EngineArgs
from jaxrunner.model_runner import ModelRunner
from jaxrunner.sampling_params import SamplingParams
from jaxrunner.schedule_batch import Req
from jaxrunner.scheduler import Scheduler
from models.config import ModelConfig


class Engine:
    """Loads a Hugging Face checkpoint, compiles every bucket, and generates.

    ```python
    engine = Engine(model_path="hf_dir", dtype="float32", page_size=16)
    outs = engine.generate(input_ids=[[1, 2, 3], [4, 5]],
                           sampling_params={"max_new_tokens": 8, "temperature": 0.0})
    engine.shutdown()
    ```
    Arguments are the fields of `EngineArgs`.
    """

    def __init__(self, **kwargs):
        self.args = EngineArgs.from_kwargs(**kwargs)
        self.model_config = ModelConfig.from_pretrained(self.args.model_path)
        self.tokenizer = None
        if not self.args.skip_tokenizer_init:
            self.tokenizer = AutoTokenizer.from_pretrained(self.args.tokenizer_path
                                                           or self.args.model_path)
        self.compile_monitor = CompileMonitor()
        self.runner = ModelRunner(self.args, self.model_config, self.compile_monitor)
        if self.args.disallow_compile_after_warmup:
            self.compile_monitor.forbid()
        self.scheduler = Scheduler(self.runner, self._decode if self.tokenizer else None)
        self._rids = itertools.count()
        self._seeds = random.Random(self.args.random_seed)

    @property
    def context_len(self) -> int:
        return self.runner.context_len

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- requests ----

    def generate(self, prompt=None, sampling_params=None, input_ids=None,
                 return_logprob: bool | list[bool] = False):
        """Generates for one prompt (a dict back) or a list of prompts (a list of dicts back).

        `prompt` is text (or a list of texts), `input_ids` token ids (or a list of lists); give
        one. `sampling_params` is a dict of `SamplingParams` fields, or a list of dicts, one per
        request. Every request is validated before any runs: a bad one raises ValueError naming
        it, and nothing is enqueued.
        """
        single, prompts = self._normalize_prompts(prompt, input_ids)
        n = len(prompts)
        params = self._per_request(sampling_params, n, "sampling_params", default={})
        logprob_flags = self._per_request(return_logprob, n, "return_logprob", default=False)
        reqs = [self._make_req(i, ids, p, lp)
                for i, (ids, p, lp) in enumerate(zip(prompts, params, logprob_flags))]
        for req in reqs:
            self.scheduler.add_request(req)
        while not all(r.finished for r in reqs):
            self.scheduler.step()
        outputs = [self._output(r) for r in reqs]
        return outputs[0] if single else outputs

    def _normalize_prompts(self, prompt, input_ids) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set)")
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise ValueError(f"prompt {i} must be a string, got {type(text).__name__}")
            return single, [self.tokenizer.encode(t) for t in texts]
        single = len(input_ids) > 0 and not isinstance(input_ids[0], (list, tuple))
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

    def _make_req(self, index: int, ids: list[int], params, return_logprob: bool) -> Req:
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError(f"request {index}: empty prompt")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"request {index}: token id {t!r} is outside the vocabulary "
                                 f"[0, {vocab})")
        if len(ids) >= self.context_len:
            raise ValueError(f"request {index}: prompt of {len(ids)} tokens does not fit the "
                             f"context length {self.context_len} (it must leave room for one "
                             f"new token)")
        if isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"request {index}: sampling_params must be a dict")
        try:
            params.verify(vocab)
        except ValueError as e:
            raise ValueError(f"request {index}: {e}") from None
        params = params.normalized()
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        return Req(rid=next(self._rids), origin_input_ids=ids, sampling_params=params, seed=seed,
                   max_new_tokens=min(params.max_new_tokens, self.context_len - len(ids)),
                   eos_token_ids=frozenset(self.model_config.eos_token_ids),
                   return_logprob=bool(return_logprob))

    def _output(self, req: Req) -> dict:
        meta = {"id": str(req.rid), "prompt_tokens": len(req.origin_input_ids),
                "completion_tokens": len(req.output_ids), "finish_reason": req.finished_reason}
        if req.return_logprob:
            meta["output_token_logprobs"] = [(lp, t, None)
                                             for lp, t in zip(req.output_logprobs, req.output_ids)]
        out = {"output_ids": list(req.output_ids), "meta_info": meta}
        if self.tokenizer is not None:
            out["text"] = (req.stopped_text if req.stopped_text is not None
                           else self._decode(req.output_ids))
        return out

    # ---- lifecycle ----

    def shutdown(self) -> None:
        self.compile_monitor.close()
        self.runner = None
        self.scheduler = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
