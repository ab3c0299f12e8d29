def ragged_paged_attention_gpu(*args, **kwargs):
  raise NotImplementedError
