"""Speculative decoding: proposers (draft model, n-gram) and the exact acceptance rule."""
