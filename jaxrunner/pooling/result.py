"""What a pooling model's step gives the scheduler: no tokens, the pooled results."""

from dataclasses import dataclass

import jax
import numpy as np


@dataclass
class PoolingBatchResult:
    """A launched pooling step; its arrays stay on the device until read."""

    pooler_output: object          # jaxrunner/pooling/step.py PoolerOutput
    num_reqs: int
    next_token_ids: jax.Array      # the runner's zeros: no request reads a token of this step

    def copy_to_host(self) -> tuple[np.ndarray, np.ndarray]:
        """Nothing is sampled: zeros for the real rows (their requests end here)."""
        return np.zeros(self.num_reqs, np.int32), np.zeros(self.num_reqs, np.float32)

    def pooled_to_host(self) -> np.ndarray:
        """f32[n, E]: the real rows' pooled results; waits for the step."""
        return np.asarray(self.pooler_output.pooled)[:self.num_reqs]

    def top_logprobs_to_host(self):
        raise NotImplementedError("a pooling model's step has no log-probabilities")

    def input_logprobs_to_host(self):
        raise NotImplementedError("a pooling model's step has no log-probabilities")

    def hidden_states_to_host(self):
        raise NotImplementedError("a pooling model's step returns its pooled results")
