"""The speculative tests' draft heads and their reference: the target's own greedy tokens."""

import pytest

from models.testing.random_checkpoint import make_eagle_checkpoint
from tests.support.files import made_once
from tests.support.speculative import serve_checked, speculative_workload


@pytest.fixture(scope="session")
def eagle_head(checkpoint_root):
    """`eagle_head(algorithm, target_preset)` -> a random EAGLE or EAGLE-3 head for the preset
    (reading layers 0, 1 and 1 for EAGLE-3), made once per run."""
    made = {}

    def get(algorithm, target_preset):
        key = (algorithm, target_preset)
        if key not in made:
            made[key] = made_once(
                checkpoint_root / f"{target_preset}-{algorithm.lower()}",
                lambda path: make_eagle_checkpoint(path, algorithm, target_preset,
                                                   aux_layer_ids=[0, 1, 1]))
        return made[key]
    return get


@pytest.fixture(scope="session")
def greedy_workload(checkpoint, engine_kwargs):
    """`greedy_workload(preset)` -> (prompts, params, the target's greedy output ids) of the
    speculative workload served without speculation (checked as every speculative engine is),
    once per preset."""
    done = {}

    def get(preset):
        if preset not in done:
            prompts, params = speculative_workload(1024)
            outs = serve_checked(checkpoint(preset), engine_kwargs, prompts, params)
            done[preset] = prompts, params, [o["output_ids"] for o in outs]
        return done[preset]
    return get
