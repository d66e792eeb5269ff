"""Speculative decoding: the EAGLE-3 chain proposer, verification and acceptance statistics."""
