"""Speculative decoding: proposers (n-gram, draft model), the verify step, and the scheduler's roll-back
(docs/spec_decode.md)."""
