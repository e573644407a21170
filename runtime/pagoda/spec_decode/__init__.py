"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and the rejection sampler that
verifies their drafts against the target model (docs/speculative-decoding.md)."""
