"""fmha inside other libraries' attention slots.

* :mod:`fmha.integrations.sdpa`: PyTorch's flash-attention registry
  (``torch.nn.attention.activate_flash_attention_impl("FMHA")``): SDPA's flash backend,
  ``torch.nn.attention.varlen.varlen_attn`` and PyTorch's context parallelism run fmha's kernels.
* :mod:`fmha.integrations.transformers`: ``attn_implementation="fmha"`` in Hugging Face
  transformers 5 (registered when imported; not imported here, transformers is optional: the
  ``hf`` extra).
"""

from . import sdpa  # noqa: F401  (registers "FMHA"; activating it is the user's choice)
