"""Runs the engine under a simulated device count and prints JSON; launched by the tests in a
subprocess because the device count must be fixed before jax is imported.

    python tests/parallel/driver.py '{"devices": 8, "model_path": DIR, "runs": [{"tp_size": 2}],
                                      "prompts": [[...]], "max_new_tokens": 8, ...}'

Prints one JSON line: {"results": [{"tp_size": 2, "output_ids": [[...]], "compiles_after_warmup":
0, ...}, ...]}. The keys of each run are `EngineArgs` fields laid over `engine_kwargs`; a
"lora_path" list names each prompt's LoRA adapter. A multi-host run (`nnodes` > 1) is one
process per rank; each adds "finished" (rid -> output ids of the requests it finished), and
"lockstep_lifecycle" ({"first", "second"}: two checkpoints) adds rank 0's lifecycle scenario.
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
    from jaxrunner.engine.lockstep import LockstepEngine  # noqa: PLC0415

    results = []
    for run in spec["runs"]:
        run = dict(run)
        rebalance = run.pop("rebalance", False)  # a MoE run: see rebalance_report
        kwargs = {**spec.get("engine_kwargs", {}), "model_path": spec["model_path"], **run}
        engine = Engine(**kwargs)
        warm = engine.compile_monitor.count
        params = {"max_new_tokens": spec["max_new_tokens"], "temperature": 0.0,
                  "ignore_eos": True}
        if kwargs.get("nnodes", 1) > 1:  # one run per process
            return multihost_report(engine, LockstepEngine(engine), run, spec, params)
        extra = {}
        if kwargs.get("dp_size", 1) > 1:
            # The first prompt alone (rank 1 idles while rank 0 works), then the rest.
            prompts = spec["prompts"]
            outs = (engine.generate(input_ids=prompts[:1], sampling_params=params)
                    + engine.generate(input_ids=prompts[1:], sampling_params=params))
            extra = dp_report(engine)
        else:
            outs = engine.generate(input_ids=spec["prompts"], sampling_params=params,
                                   lora_path=spec.get("lora_path"))
        results.append(dict(run, output_ids=[o["output_ids"] for o in outs],
                            compiles_after_warmup=engine.compile_monitor.count - warm,
                            num_devices=engine.runner.parallel.num_devices,
                            kv_cache_shape=list(engine.runner.token_to_kv_pool.layer_shape),
                            jax_devices=jax.device_count(),
                            executable_cache_hits=getattr(engine.runner.compiler.cache,
                                                          "hits", 0), **extra))
        if rebalance:
            results[-1].update(rebalance_report(engine, spec["skewed_prompts"], params),
                               rebalance=True)
            if spec.get("update_from"):
                results[-1].update(expert_update_report(engine, spec, params))
        if spec.get("decode_hlo"):
            results[-1]["decode_hlo"] = decode_hlo_summary(engine)
        if spec.get("lifecycle"):
            results[-1]["lifecycle"] = lifecycle_report(engine, spec, params)
        engine.shutdown()
    return {"results": results}


def multihost_report(engine, lockstep, run: dict, spec: dict, params: dict) -> dict:
    """Rank 0: the prompts' tokens (and with "lockstep_lifecycle" the lifecycle scenario) and
    the output ids of every request it finished, by rid; the followers: the output ids of every
    request they finished, by rid (they must equal rank 0's)."""
    import jax  # noqa: PLC0415

    warm = engine.compile_monitor.count
    states = record_states(engine, lockstep) if spec.get("lockstep_lifecycle") else []
    if not lockstep.is_leader:
        # The lifecycle scenario's requests: the prompts, 3 times more.
        report = follower_report(engine, lockstep, 4 * len(spec["prompts"])
                                 if spec.get("lockstep_lifecycle") else None)
        return dict(report, states=states)
    finished = {}
    outs = lockstep.generate(spec["prompts"], params)
    result = dict(run, output_ids=[o["output_ids"] for o in outs],
                  compiles_after_warmup=engine.compile_monitor.count - warm,
                  process_count=jax.process_count(), jax_devices=jax.device_count())
    if spec.get("lockstep_lifecycle"):
        result["lifecycle"] = lockstep_lifecycle_report(engine, lockstep, spec, params)
    for o in outs:
        finished[o["meta_info"]["id"]] = o["output_ids"]
    finished.update(result.get("lifecycle", {}).pop("finished", {}))
    lockstep.shutdown()
    return {"results": [result], "finished": finished, "states": states}


def record_states(engine, lockstep) -> list:
    """After each lock-step verb this rank runs, [verb, the weights' checksum per tensor, the
    prefix cache's nodes]: appended to the list returned. The checksums are one program over
    every host's shards (run by every rank at the same point, as the verb was); a verb that
    stops the ranks (EngineDeadError) records nothing."""
    from flax import nnx  # noqa: PLC0415
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415

    states, run_call = [], lockstep._run_call
    replicated = NamedSharding(engine.runner.parallel.mesh, PartitionSpec())

    def checksum(x):
        """uint32 sum of the tensor's bits, each weighted by its index (order matters)."""
        bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32).reshape(-1)
        weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + 1
        return jnp.sum(bits * weights, dtype=jnp.uint32)

    program = jax.jit(lambda xs: [checksum(x) for x in xs], out_shardings=replicated)

    def weights():
        flat = [(".".join(map(str, path)), v.get_value())
                for path, v in nnx.to_flat_state(engine.runner.state)]
        if not all(isinstance(x, jax.Array) for _, x in flat):
            return "released"
        with engine.compile_monitor.allowed():
            sums = program([x for _, x in flat])
        return {name: int(s) for (name, _), s in zip(flat, sums)}

    def radix():
        nodes, todo = [], [(engine.scheduler.tree_cache.root, ())]
        while todo:
            node, prefix = todo.pop()
            key = prefix + tuple(node.key)
            nodes.append([list(key), list(node.pages), node.lock_ref])
            todo += [(child, key) for child in node.children.values()]
        return sorted(nodes)

    def recorded(call):
        outcome = run_call(call)
        states.append([call.verb, weights(), radix()])
        return outcome

    lockstep._run_call = recorded
    return states


def follower_report(engine, lockstep, lifecycle_requests: int | None) -> dict:
    """Follows rank 0; the output ids of every request finished here, by rid. After
    `lifecycle_requests` requests the second flush from then on fails here alone (rank 0's
    succeeds), and following ends with EngineDeadError ("dead")."""
    from jaxrunner.engine.base import EngineDeadError  # noqa: PLC0415

    finished = {}

    def record(req):
        finished[str(req.rid)] = list(req.output_ids)
        if len(finished) == lifecycle_requests:
            break_second_flush(engine.scheduler)

    try:
        lockstep.follow(on_finish=record)
    except EngineDeadError as e:  # a real follower's process exits here (status 1)
        return {"results": [], "finished": finished, "dead": str(e)}
    return {"results": [], "finished": finished}


def break_second_flush(scheduler) -> None:
    """The divergence check's test seam: this rank's second prefix-cache flush from now on
    raises (rank 0's succeeds)."""
    flush, calls = scheduler.flush_cache, []

    def flaky_flush():
        calls.append(None)
        if len(calls) == 2:
            raise RuntimeError("injected failure of this rank's flush")
        return flush()

    scheduler.flush_cache = flaky_flush


def lockstep_lifecycle_report(engine, lockstep, spec: dict, params: dict) -> dict:
    """Lifecycle verbs in the middle of serving, each run on every rank: with requests in
    flight a refused flush and an update from disk (they finish on the old weights); the prompts
    on the new weights; a weight read; a verb every rank refuses; release and resume without a
    backup (requests refused), then rank 0's tensors of the first checkpoint sent to every
    rank; the prompts again; a flush; then a flush that fails on rank 1 alone."""
    from pathlib import Path  # noqa: PLC0415

    from safetensors.numpy import load_file  # noqa: PLC0415

    from jaxrunner.engine.base import EngineDeadError  # noqa: PLC0415
    from jaxrunner.engine.lifecycle import EngineNotReadyError  # noqa: PLC0415

    paths, prompts = spec["lockstep_lifecycle"], spec["prompts"]
    finished, report = {}, {}

    def run(reqs):
        while not all(r.finished for r in reqs):
            lockstep.step()
        finished.update({str(r.rid): list(r.output_ids) for r in reqs})
        return [list(r.output_ids) for r in reqs]

    in_flight = [lockstep.add_request(p, params) for p in prompts]
    lockstep.step()
    lockstep.step()
    report["flush_in_flight"] = lockstep.flush_cache()
    report["update_from_disk"] = list(lockstep.update_weights_from_disk(
        paths["second"], weight_version="second"))
    report["in_flight"] = run(in_flight)
    report["second"] = run([lockstep.add_request(p, params) for p in prompts])
    report["weight_version"] = lockstep.weight_version
    report["read"] = lockstep.get_weights_by_name("model.embed_tokens.weight", 2).tolist()
    try:
        lockstep.start_expert_distribution_record()
    except ValueError as e:
        report["refused"] = str(e)
    try:
        lockstep.rebalance_experts()
    except ValueError as e:
        report["rebalance_refused"] = str(e)
    lockstep.release_memory_occupation()
    lockstep.resume_memory_occupation()
    try:
        lockstep.add_request(prompts[0], params)
    except EngineNotReadyError as e:
        report["refused_while_empty"] = str(e)
    tensors = load_file(Path(paths["first"]) / "model.safetensors")
    report["update_from_tensor"] = list(lockstep.update_weights_from_tensor(tensors))
    warm = engine.compile_monitor.count
    report["first_again"] = run([lockstep.add_request(p, params) for p in prompts])
    report["serving_compiles"] = engine.compile_monitor.count - warm
    report["flush_idle"] = lockstep.flush_cache()
    # Rank 1's next flush fails (follower_report's seam): both ranks must stop, not drift.
    try:
        lockstep.flush_cache()
    except EngineDeadError as e:
        report["diverged"] = str(e)
    try:
        lockstep.step()
    except EngineDeadError:
        report["refuses_after_divergence"] = True
    report["finished"] = finished
    return report


def dp_report(engine) -> dict:
    """What a DP attention run did: its joint steps, the rank-steps run IDLE, and each rank's
    free pages and slots after `flush_cache()` (all of them, if nothing leaked)."""
    scheduler = engine.scheduler
    flushed = engine.flush_cache()
    return {"dp_steps": scheduler.forward_ct, "idle_rank_steps": scheduler.num_idle_rank_steps,
            "flushed": flushed,
            "pages_free": [[s.allocator.num_free, s.allocator.capacity] for s in scheduler.ranks],
            "slots_free": [s.req_to_token_pool.num_free_slots for s in scheduler.ranks],
            "memory_stats": engine.memory_stats()}


def lifecycle_report(engine, spec: dict, params: dict) -> dict:
    """Weights read back, a tensor update with those values (one as a numpy array, one as a JAX
    array sharded another way) and a release/resume cycle, each followed by the prompts again:
    under tensor parallelism every value must come back as it was."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    names = spec["lifecycle"]
    full = {n: engine.get_weights_by_name(n, 10**6) for n in names}
    read = {n: full[n][:4].astype(float).tolist() for n in names}
    tensors = [(names[0], full[names[0]]),
               (names[1], jax.device_put(full[names[1]], jax.devices()[-1]))]
    ok, message = engine.update_weights_from_tensor(tensors)
    warm = engine.compile_monitor.count
    after_update = engine.generate(input_ids=spec["prompts"], sampling_params=params)
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    after_resume = engine.generate(input_ids=spec["prompts"], sampling_params=params)
    readback_equal = all(np.array_equal(engine.get_weights_by_name(n, 10**6), full[n])
                         for n in names)
    return {"read": read, "update": [ok, message],
            "after_update": [o["output_ids"] for o in after_update],
            "after_resume": [o["output_ids"] for o in after_resume],
            "serving_compiles": engine.compile_monitor.count - warm,
            "readback_equal": readback_equal}
def rebalance_report(engine, prompts, params) -> dict:
    """A skewed workload, recorded; an EPLB rebalance; the same workload again, recorded: the
    tokens of both, the routed (token, choice) pairs per EP rank [MoE layers, ep] of both, and
    the compiles the rebalance and the second pass made."""
    import tempfile  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    ep = engine.args.ep_size
    passes = []
    for _ in range(2):
        assert engine.flush_cache()  # both passes compute every token (no cached prefix)
        engine.start_expert_distribution_record()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        engine.stop_expert_distribution_record()
        record = engine.dump_expert_distribution_record(tempfile.mktemp(suffix=".json"))
        physical = np.array(record["physical_count"])                  # [Lm, P]
        passes.append({"output_ids": [o["output_ids"] for o in outs],
                       "rank_loads": physical.reshape(len(physical), ep, -1).sum(-1).tolist(),
                       "logical_count": record["logical_count"]})
        if len(passes) == 1:
            compiles = engine.compile_monitor.count
            report = engine.rebalance_experts()
    return {"skewed": passes, "eplb_report": report,
            "physical_to_logical": engine.runner.expert_location.physical_to_logical.tolist(),
            "rebalance_compiles": engine.compile_monitor.count - compiles}


def expert_update_report(engine, spec: dict, params: dict) -> dict:
    """After a rebalance (experts moved and copied over the EP devices): the tensors of the
    checkpoint `update_from` written by name, the prompts' tokens; an expert read back (its
    largest error relative to the tensor's magnitude: 0 unless quantized); release, resume
    without a backup (requests refused), update from disk of the engine's own checkpoint, the
    prompts' tokens."""
    from pathlib import Path  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415
    from safetensors.numpy import load_file  # noqa: PLC0415

    from jaxrunner.engine.lifecycle import EngineNotReadyError  # noqa: PLC0415

    serving_compiles = []

    def ids():
        warm = engine.compile_monitor.count
        outs = engine.generate(input_ids=spec["prompts"], sampling_params=params)
        serving_compiles.append(engine.compile_monitor.count - warm)
        return [o["output_ids"] for o in outs]

    tensors = load_file(str(Path(spec["update_from"]) / "model.safetensors"))
    report = {"update": list(engine.update_weights_from_tensor(list(tensors.items())))}
    report["updated_ids"] = ids()
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    want = tensors[name]
    report["readback_error"] = float(np.abs(engine.get_weights_by_name(name, 10**6) - want).max()
                                     / np.abs(want).max())
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    try:
        engine.generate(input_ids=spec["prompts"][0], sampling_params=params)
    except EngineNotReadyError as e:
        report["refused_after_resume"] = str(e)
    report["update_from_disk"] = list(engine.update_weights_from_disk(spec["model_path"]))
    report["restored_ids"] = ids()
    report["update_serving_compiles"] = sum(serving_compiles)
    return report


def decode_hlo_summary(engine) -> dict:
    """The collectives of the largest decode step's compiled HLO, with their result types, and
    the shapes of the model's weights (to tell an all-gathered weight from an activation)."""
    import jax  # noqa: PLC0415

    from jaxrunner.batch.forward_mode import ForwardMode  # noqa: PLC0415

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
