"""The causal LM's compiled step (EXTEND and DECODE) and what every step that ends in logits
returns (`LogitsOutput`).

Feature plans reuse `forward_step`: a speculative target's prefill captures hidden states for
the draft (`aux_layers`, CaptureHiddenMode), a block-diffusion LM's prefill is block-causal
(`kv_bound`).
"""

from dataclasses import dataclass

from flax import nnx
import jax
import jax.numpy as jnp

from jaxrunner.batch.forward_batch import ForwardBatch
from jaxrunner.sampling.step import TOP_LOGPROBS


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LogitsOutput:
    next_token_logits: jax.Array  # f32[R, V]: logits of each request's last token
    hidden_states: jax.Array      # [T, D] with CaptureHiddenMode.FULL, [R, D] with LAST, else [0]
    # i32[MoE layers, P]: (token, choice) pairs routed to each expert slot ([0, P] if dense)
    expert_counts: jax.Array
    # Prompt log-probabilities (extend steps; [0]-sized in decode): at token t, log p of the
    # token `fb.logprob_target_ids[t]` (the prompt's next token) and the TOP_LOGPROBS most
    # likely tokens; zeros unless some token has a target.
    input_token_logprobs: jax.Array  # f32[T]
    input_top_ids: jax.Array         # i32[T, TOP_LOGPROBS]
    input_top_logprobs: jax.Array    # f32[T, TOP_LOGPROBS]


def forward_step(graphdef, backend, moe_runner, aux_layers, state, kv_cache, fb: ForwardBatch,
                 *, kv_bound=None):
    """The compiled step: the inputs still on the device and the positions, the decoder over all
    tokens, logits at each request's last token, the MoE layers' routed counts. With
    hidden-state capture, the hidden states after the final norm, or the inputs of `aux_layers`
    side by side (EAGLE-3's). `kv_bound(fb)`: each token's attention bound
    (`ForwardBatch.kv_bound`) where the step is not causal."""
    fb = fb.prepare()
    if kv_bound is not None:
        fb = fb.replace(kv_bound=kv_bound(fb))
    model = nnx.merge(graphdef, state)
    capture = fb.capture_hidden_mode
    hidden, kv_cache, aux, expert_counts = model(
        fb, kv_cache, backend, moe_runner,
        aux_layers=aux_layers if capture.need_capture() else ())
    last_hidden = hidden[fb.last_token_indices]
    captured = captured_hidden(hidden, aux)
    if capture.is_last():
        captured = captured[fb.last_token_indices]
    elif not capture.is_full():
        captured = captured[:0]
    if fb.forward_mode.is_decode():  # decode tokens are outputs: nothing of the prompt's
        input_logprobs = no_input_logprobs(0)
    else:
        input_logprobs = jax.lax.cond(
            jnp.any(fb.logprob_target_ids >= 0),
            lambda: _input_logprobs(model, hidden, fb.logprob_target_ids),
            lambda: no_input_logprobs(fb.num_tokens))
    return LogitsOutput(model.compute_logits(last_hidden), captured, expert_counts,
                        *input_logprobs), kv_cache


def captured_hidden(hidden, aux):
    """What an EAGLE head reads of the target: EAGLE-3's aux layers side by side [T, 3D], or
    the last hidden state after the final norm [T, D]."""
    if aux is None:
        return hidden
    return jnp.concatenate(list(aux), axis=-1)


def no_input_logprobs(num_tokens: int):
    """LogitsOutput's prompt logprob fields for a step that computes none."""
    return (jnp.zeros(num_tokens, jnp.float32), jnp.zeros((num_tokens, TOP_LOGPROBS), jnp.int32),
            jnp.zeros((num_tokens, TOP_LOGPROBS), jnp.float32))


def _input_logprobs(model, hidden, targets):
    """Every token's log p(target) and top alternatives, a block of tokens at a time so the
    [tokens, V] logits stay small."""
    T = hidden.shape[0]
    block = next(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if T % b == 0)

    def one_block(args):
        h, t = args
        logits = model.compute_logits(h)  # f32[block, V]
        normaliser = jax.nn.logsumexp(logits, axis=-1)
        chosen = jnp.take_along_axis(logits, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
        values, ids = jax.lax.top_k(logits, TOP_LOGPROBS)
        return chosen - normaliser, ids.astype(jnp.int32), values - normaliser[:, None]

    lps, ids, tops = jax.lax.map(one_block, (hidden.reshape(T // block, block, -1),
                                             targets.reshape(T // block, block)))
    return lps.reshape(T), ids.reshape(T, TOP_LOGPROBS), tops.reshape(T, TOP_LOGPROBS)
