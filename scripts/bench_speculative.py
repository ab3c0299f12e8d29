"""Speculative decoding against plain decoding: output tok/s and accept length per algorithm, batch
size and workload, in one run; prints JSON and a table.

    python scripts/bench_speculative.py                         # built-in small-repeat model
    python scripts/bench_speculative.py --algorithms NGRAM EAGLE --batch-sizes 1 4
    python scripts/bench_speculative.py --simulate-accept 0.5 0.9   # + forced acceptance

For each algorithm one engine serves every (workload, batch size): `batch` requests at once,
greedy, `--output-len` tokens each, timed after a warm-up. Workloads:
- `repeat`: prompts the model repeats: the cycle its own long greedy generation ends in (the
  default model's next token is a function of the current one; see `small-repeat` in
  models/testing/random_checkpoint.py), what n-gram lookup is for (code edits, quoting, retrieval);
- `random`: random prompts.
Drafts: NGRAM needs none; STANDALONE uses `--draft-model-path` (default: the built-in
`small-draft`, a 2-layer model of the same vocabulary); EAGLE and EAGLE3 random heads in their
checkpoint formats (models/testing/random_checkpoint.py). `X-tree` is algorithm X drafting trees
(`--tree-topk` branches per step, NGRAM's continuations, `--tree-draft-tokens` nodes). Random
drafts are rarely right, so `--simulate-accept p` also runs each model-drafted algorithm with
the acceptance forced (each draft kept with probability p, SGLang's simulated acceptance): the
cost model of an algorithm independent of how good its draft is (chains: the forced rule
replaces the chain's acceptance, so trees are not simulated). Accept length is SGLang's:
completion tokens / verify rounds.
"""

import argparse
import json
from pathlib import Path
import time

from bench_common import emit, machine_info, print_grid
import numpy as np

from jaxrunner import Engine
from models.testing.random_checkpoint import cached_checkpoint, make_eagle_checkpoint

ROOT = Path(__file__).resolve().parent.parent
ALGORITHMS = ("none", "NGRAM", "NGRAM-tree", "STANDALONE", "STANDALONE-tree", "EAGLE",
              "EAGLE-tree", "EAGLE3", "EAGLE3-tree")
TREE = "-tree"
FIRST_ORDINARY_ID = 8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="target checkpoint (default: the built-in `small-repeat`, "
                   "the benchmark model's shapes with faint residual writes, so it repeats)")
    p.add_argument("--draft-model-path", help="STANDALONE's draft (default: small-draft)")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--workloads", nargs="+", default=["repeat", "random"],
                   choices=("repeat", "random"))
    p.add_argument("--num-steps", type=int, default=4, help="speculative_num_steps")
    p.add_argument("--tree-topk", type=int, default=2,
                   help="the -tree algorithms: speculative_eagle_topk")
    p.add_argument("--tree-draft-tokens", type=int, default=8,
                   help="the -tree algorithms: speculative_num_draft_tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-prefill-tokens", type=int,
                   help="the engines' max_prefill_tokens (default: max(256, prompt length))")
    p.add_argument("--simulate-accept", type=float, nargs="*", default=[],
                   help="also run model drafts with each draft accepted with this probability")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compilation-cache-dir", default=str(ROOT / ".jax_cache"))
    p.add_argument("--json-out")
    return p.parse_args(argv)


def make_prompts(engine, workload, n, prompt_len, seed):
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    prompts = [rng.integers(FIRST_ORDINARY_ID, vocab, size=prompt_len).tolist() for _ in range(n)]
    if workload == "random":
        return prompts
    outs = engine.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": min(max(512, 4 * prompt_len), engine.context_len - prompt_len - 1),
        "temperature": 0.0, "ignore_eos": True})
    return [repeating_prompt(o["output_ids"], prompt_len) for o in outs]


def repeating_prompt(output: list[int], prompt_len: int) -> list[int]:
    """The greedy cycle `output` ends in, repeated to at least `prompt_len` tokens and ending
    where `output` does (so the model continues it); the last `prompt_len` tokens when no
    cycle shows."""
    for period in range(1, len(output) // 2 + 1):
        if output[-period:] == output[-2 * period:-period]:
            cycle = output[-period:]
            return (cycle * -(-prompt_len // period))[-max(prompt_len, period):]
    return output[-prompt_len:]


def timed_run(engine, prompts, output_len):
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=prompts[:1], sampling_params=dict(params, max_new_tokens=4))
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - t0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    rounds = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    return {"elapsed_s": elapsed, "output_tokens": tokens,
            "output_throughput": tokens / elapsed,
            "accept_length": tokens / rounds if rounds else None,
            "output_ids": [o["output_ids"] for o in outs]}


def simulated_acceptance(rate: float):
    """A replacement for `acceptance.accept_drafts` that keeps each draft with probability
    `rate` (whatever the target says) and then the target's own token."""
    import jax
    import jax.numpy as jnp

    from jaxrunner.speculative import acceptance

    real = acceptance.accept_drafts

    def accept(logits, drafts, num_drafts, sampling):
        _, tokens, logprobs = real(logits, drafts, num_drafts, sampling)
        R, W = tokens.shape
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s + 7), n))(
            sampling.seeds, sampling.steps + jnp.arange(R))
        keep = jax.vmap(lambda k: jax.random.uniform(k, (W - 1,)) < rate)(keys)
        keep &= jnp.arange(W - 1)[None, :] < num_drafts[:, None]
        accept_len = acceptance.leading_true(keep)
        slot = jnp.arange(W)[None, :]
        forced = jnp.where(slot < accept_len[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                           jnp.where(slot == accept_len[:, None], tokens[:, :1], 0))
        return accept_len, forced, logprobs
    return accept


def engine_for(args, model_path, algorithm, draft_paths, cache=True):
    kwargs = dict(model_path=model_path, dtype=args.dtype, skip_tokenizer_init=True,
                  compilation_cache_dir=args.compilation_cache_dir if cache else None,
                  disallow_compile_after_warmup=True, show_progress=False,
                  max_running_requests=max(args.batch_sizes),
                  max_prefill_tokens=args.max_prefill_tokens or max(256, args.prompt_len))
    if algorithm.endswith(TREE):
        kwargs.update(speculative_eagle_topk=args.tree_topk,
                      speculative_num_draft_tokens=args.tree_draft_tokens)
        algorithm = algorithm.removesuffix(TREE)
    if algorithm != "none":
        kwargs.update(speculative_algorithm=algorithm, speculative_num_steps=args.num_steps)
        if algorithm in draft_paths:
            kwargs["speculative_draft_model_path"] = draft_paths[algorithm]
    return Engine(**kwargs)


def main(argv=None) -> dict:
    args = parse_args(argv)
    preset = None if args.model_path else "small-repeat"
    model_path = args.model_path or str(cached_checkpoint(preset, ROOT / "checkpoints"))
    draft_paths = {"STANDALONE": args.draft_model_path or str(
        cached_checkpoint("small-draft", ROOT / "checkpoints"))}
    for algorithm in ("EAGLE", "EAGLE3"):
        if algorithm in {a.removesuffix(TREE) for a in args.algorithms}:
            if preset is None:
                raise SystemExit(f"{algorithm} heads are made for the built-in model; give "
                                 f"--model-path only with NGRAM / STANDALONE")
            out = ROOT / "checkpoints" / f"{preset}-{algorithm.lower()}"
            if not (out / "model.safetensors").is_file():
                make_eagle_checkpoint(out, algorithm, preset)
            draft_paths[algorithm] = str(out)

    runs, prompts = [], {}
    variants = [(a, None) for a in args.algorithms]
    variants += [(a, rate) for rate in args.simulate_accept
                 for a in args.algorithms if a not in ("none", "NGRAM") and not a.endswith(TREE)]
    from jaxrunner.speculative import steps
    real_accept = steps.accept_drafts
    for algorithm, rate in variants:
        # The verify step traces `steps.accept_drafts`; a forced rule gets no executable cache
        # (its programs must not be stored under the real rule's key).
        steps.accept_drafts = simulated_acceptance(rate) if rate is not None else real_accept
        try:
            engine = engine_for(args, model_path, algorithm, draft_paths,
                                cache=rate is None)
        finally:
            steps.accept_drafts = real_accept
        try:
            for workload in args.workloads:
                if workload not in prompts:  # the same prompts for every algorithm
                    prompts[workload] = make_prompts(engine, workload, max(args.batch_sizes),
                                                     args.prompt_len, seed=0)
                for batch in args.batch_sizes:
                    run = timed_run(engine, prompts[workload][:batch], args.output_len)
                    runs.append({"algorithm": algorithm, "simulated_accept": rate,
                                 "workload": workload, "batch_size": batch, **run})
                    print(json.dumps({k: v for k, v in runs[-1].items() if k != "output_ids"}),
                          flush=True)
        finally:
            engine.shutdown()

    base = {(r["workload"], r["batch_size"]): r for r in runs if r["algorithm"] == "none"}
    for r in runs:
        b = base.get((r["workload"], r["batch_size"]))
        if b is not None:
            r["speedup"] = r["output_throughput"] / b["output_throughput"]
            if r["simulated_accept"] is None:
                r["same_tokens_as_plain"] = r["output_ids"] == b["output_ids"]
    for r in runs:
        del r["output_ids"]
    result = {"machine": machine_info(), "model_path": model_path, "num_steps": args.num_steps,
              "tree_topk": args.tree_topk, "tree_draft_tokens": args.tree_draft_tokens,
              "output_len": args.output_len, "runs": runs}
    emit(result, args.json_out)
    print_grid(["algorithm", "sim. accept", "workload", "batch", "tok/s", "accept len",
                "speed-up", "same tokens"],
               [[r["algorithm"], "-" if r["simulated_accept"] is None else r["simulated_accept"],
                 r["workload"], r["batch_size"], r["output_throughput"],
                 "-" if r["accept_length"] is None else r["accept_length"],
                 r.get("speedup", "-"), r.get("same_tokens_as_plain", "-")] for r in runs])
    return result


if __name__ == "__main__":
    main()
