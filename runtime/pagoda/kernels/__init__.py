"""Triton kernels for the GPU path; the torch code they replace stays as the CPU path and the reference.

One module per kernel family, each with one public launcher that validates its arguments:

- ``paged_attention``: mixed batches (decodes, prefill chunks, prefix-cache hits) in one launch
- ``flash_decode``: split-K decode over partitions of long contexts, plus the reduction
- ``kv_cache``: scatter a step's new keys and values into their cache slots
- ``rmsnorm``: RMSNorm, optionally fused with the residual add
- ``rotary``: rotary embedding of q and k in place

``paged_kv`` holds what the attention kernels share: int64 addressing of the paged cache and the
online-softmax loop over a range of context positions. ``_checks`` holds the launchers' argument checks.

Without a GPU the kernels run only in Triton's interpreter: set ``TRITON_INTERPRET=1`` before this package
is imported (Triton reads it when the kernels are defined).
"""
