"""Runs the engine under a simulated device count and prints JSON; launched by the tests in a
subprocess because the device count must be fixed before jax is imported.

    python tests/parallel/driver.py '{"devices": 8, "model_path": DIR, "runs": [{"tp_size": 2}],
                                      "prompts": [[...]], "max_new_tokens": 8, ...}'

Prints one JSON line: {"results": [{"tp_size": 2, "output_ids": [[...]], "compiles_after_warmup":
0, ...}, ...]}. The keys of each run are `EngineArgs` fields laid over `engine_kwargs`.
"""

import json
import os
import re
import sys

_COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")


def main(spec: dict) -> dict:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={spec['devices']}")
    import jax  # noqa: PLC0415 (the device count above must come first)

    from jaxrunner import Engine  # noqa: PLC0415
    from jaxrunner.distributed import LockstepEngine  # noqa: PLC0415

    results = []
    for run in spec["runs"]:
        kwargs = dict(spec.get("engine_kwargs", {}), model_path=spec["model_path"], **run)
        engine = Engine(**kwargs)
        warm = engine.compile_monitor.count
        params = {"max_new_tokens": spec["max_new_tokens"], "temperature": 0.0,
                  "ignore_eos": True}
        if kwargs.get("nnodes", 1) > 1:  # one run per process; rank 0 reports
            lockstep = LockstepEngine(engine)
            warm = engine.compile_monitor.count
            if not lockstep.is_leader:
                lockstep.follow()
                return {"results": []}
            outs = lockstep.generate(spec["prompts"], params)
            compiles = engine.compile_monitor.count - warm
            lockstep.shutdown()
            return {"results": [dict(run, output_ids=[o["output_ids"] for o in outs],
                                     compiles_after_warmup=compiles,
                                     process_count=jax.process_count(),
                                     jax_devices=jax.device_count())]}
        if kwargs.get("dp_size", 1) > 1:
            output_ids = dp_generate(engine, spec["prompts"], params)
            outs = [{"output_ids": ids} for ids in output_ids]
        else:
            outs = engine.generate(input_ids=spec["prompts"], sampling_params=params)
        results.append(dict(run, output_ids=[o["output_ids"] for o in outs],
                            compiles_after_warmup=engine.compile_monitor.count - warm,
                            num_devices=engine.runner.parallel.num_devices,
                            kv_cache_shape=list(engine.runner.token_to_kv_pool.shape),
                            jax_devices=jax.device_count()))
        if spec.get("decode_hlo"):
            results[-1]["decode_hlo"] = decode_hlo_summary(engine)
        engine.shutdown()
    return {"results": results}


def dp_generate(engine, prompts, params) -> list[list[int]]:
    """Greedy generation over DP attention ranks, with a minimal scheduler per rank: prompt i
    goes to rank i % dp; a rank prefills all it has waiting, else decodes what it runs. Rank 1's
    requests arrive one step late, so rank 1 starts IDLE and then extends while rank 0 decodes;
    the rank that finishes first idles while the other decodes."""
    from jaxrunner.dp_attention import DataParallelStep  # noqa: PLC0415
    from jaxrunner.forward_mode import ForwardMode  # noqa: PLC0415
    from jaxrunner.schedule_batch import ScheduleBatch  # noqa: PLC0415

    runner = engine.runner
    step = DataParallelStep(runner)
    dp, page_size = step.dp_size, runner.args.page_size
    reqs = [engine._make_req(list(p), dict(params), False, 0) for p in prompts]
    waiting = [[req for i, req in enumerate(reqs) if i % dp == r] for r in range(dp)]
    running = [[] for _ in range(dp)]
    step_no = 0
    while not all(r.finished for r in reqs):
        batches = []
        for r in range(dp):
            pool, alloc = runner.dp_req_to_token_pools[r], runner.dp_allocators[r]
            if waiting[r] and (r == 0 or step_no > 0):
                lens = [len(q.origin_input_ids) for q in waiting[r]]
                batch = ScheduleBatch(waiting[r], ForwardMode.EXTEND, lens, pool, alloc, page_size)
                running[r] += waiting[r]
                waiting[r] = []
            elif running[r]:
                batch = ScheduleBatch(list(running[r]), ForwardMode.DECODE, [1] * len(running[r]),
                                      pool, alloc, page_size)
            else:
                batches.append(None)
                continue
            assert batch.alloc_kv()
            batches.append(batch)
        for r, (batch, (tokens, _)) in enumerate(zip(batches, step.run(batches))):
            for req, n, token in zip(batch.reqs if batch else [], batch.extend_lens if batch else [],
                                     tokens):
                req.num_computed_tokens += n
                req.output_ids.append(int(token))
                if len(req.output_ids) >= req.max_new_tokens:
                    req.finished_reason = {"type": "length"}
                    runner.dp_allocators[r].free(
                        runner.dp_req_to_token_pools[r].free_slot(req.req_pool_idx))
                    running[r].remove(req)
        step_no += 1
    return [r.output_ids for r in reqs]


def decode_hlo_summary(engine) -> dict:
    """The collectives of the largest decode step's compiled HLO, with their result types, and
    the shapes of the model's weights (to tell an all-gathered weight from an activation)."""
    from jaxrunner.forward_mode import ForwardMode  # noqa: PLC0415

    import jax  # noqa: PLC0415

    runner = engine.runner
    (bucket, capture), compiled = max(
        ((key, c) for key, c in runner.executables.items() if key[0].mode == ForwardMode.DECODE),
        key=lambda kc: kc[0][0].num_reqs)
    collectives = [[op, result] for result, op in _COLLECTIVE.findall(compiled.as_text())]
    weights = sorted({tuple(x.shape) for x in jax.tree.leaves(runner.state)})
    return {"batch_size": bucket.num_reqs, "collectives": collectives,
            "weight_shapes": [list(s) for s in weights]}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
