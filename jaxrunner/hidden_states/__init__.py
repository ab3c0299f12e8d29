"""`return_hidden_states` (SGLang's): requests get the hidden states after the final norm of
their tokens. With `enable_return_hidden_states` the causal LM's programs capture them through
the capture machinery (`CaptureHiddenMode`: prefill steps every token's, decode steps each
request's); the scheduler reads them back only for steps with a request that asked
(jaxrunner/scheduler/request_output.py)."""
