"""What an RL framework drives between rollouts (SGLang's names and semantics): free the engine's
device memory while a trainer runs, bring it back, push new weights, read them back.

- Requests in flight: each call first lets the requests in the engine finish on the weights
  they started with (it steps the engine until none is left: SGLang's default), or, with
  `abort_all_requests=True`, aborts them (`finish_reason` "abort", their pages freed at once).
  Nothing accepted is lost or silently run on two sets of weights.
- While memory is released (either tag), new requests are refused with `EngineNotReadyError`
  (the server answers 503) until `resume_memory_occupation`. Refused rather than queued: a
  framework releases memory exactly when it will not generate, and a queued request would wait
  for the trainer without a word.
- After `resume_memory_occupation` without `enable_weights_cpu_backup` the weights are zeros;
  requests are refused until `update_weights_from_disk` (or `update_weights_from_tensor` of
  every tensor) fills them.
- Weight updates keep every shape, dtype and sharding, so no step executable is recompiled
  (the small programs a partial update uses compile once, on first use); the prefix cache is
  flushed, so no prefix computed with the old weights is reused.
"""

from jaxrunner.runner.memory_tags import check_memory_tags


class EngineNotReadyError(RuntimeError):
    """The engine cannot take requests now: its memory is released or its weights not loaded."""


class EngineLifecycle:
    """Mixed into `Engine` (uses its runner, scheduler, `step` and `flush_cache`)."""

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Frees the device memory of `tags`: "weights", "kv_cache" (None: both). Requests in
        the engine finish first; releasing the KV cache flushes the prefix cache."""
        tags = check_memory_tags(tags)
        self._finish_requests(abort_all_requests=False)
        if "kv_cache" in tags:
            self.flush_cache()
        self.runner.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Allocates `tags` again (None: both): the KV cache empty, the weights from their host
        copy (`enable_weights_cpu_backup`) or as zeros to be updated."""
        self.runner.resume_memory_occupation(check_memory_tags(tags))

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False,
                                 weight_version: str | None = None) -> tuple[bool, str]:
        """Replaces every weight from the checkpoint at `model_path` (same architecture and
        shapes; `load_format` as the engine argument, None: the engine's own, "auto" if that
        was "dummy"). Returns (success, message); a checkpoint that does not fit fails before
        anything changes."""
        if load_format is None:
            load_format = "auto" if self.args.load_format == "dummy" else self.args.load_format
        try:
            self._finish_requests(abort_all_requests)
            used = self.runner.weights.update_from_disk(model_path, load_format)
        except (ValueError, OSError) as e:
            return False, f"failed to update the weights from {model_path}: {e}"
        self.flush_cache()
        self._new_version(weight_version)
        return True, f"updated the weights from {model_path} ({used})"

    def update_weights_from_tensor(self, named_tensors, abort_all_requests: bool = False,
                                   weight_version: str | None = None,
                                   flush_cache: bool = True) -> tuple[bool, str]:
        """Replaces the tensors in `named_tensors`, (Hugging Face name, numpy or JAX array in
        the checkpoint's layout) pairs or a dict; the others keep their values. Returns
        (success, message); an unknown name or a wrong shape fails before anything changes.
        `flush_cache=False` keeps the prefix cache (for several updates in a row: flush after
        the last, or prefixes computed with the old weights are reused)."""
        try:
            self._finish_requests(abort_all_requests)
            names = self.runner.weights.update_from_tensors(named_tensors)
        except ValueError as e:
            return False, f"failed to update the weights: {e}"
        if flush_cache:
            self.flush_cache()
        self._new_version(weight_version)
        return True, f"updated {len(names)} tensor(s)"

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        """Tensor `name` (a Hugging Face name) as the checkpoint holds it, its first
        `truncate_size` rows, as a numpy array. Raises ValueError for an unknown name."""
        return self.runner.weights.get(name, truncate_size)

    def _finish_requests(self, abort_all_requests: bool) -> None:
        """No request left in the engine and no step on the device."""
        if abort_all_requests:
            for req in self.unfinished_requests():
                self.scheduler.abort_request(req, "aborted for a weight update")
        while self.has_unfinished_requests:
            self.step()
        self.runner.synchronize()

    def _new_version(self, weight_version: str | None) -> None:
        if weight_version is not None:
            self.weight_version = str(weight_version)
