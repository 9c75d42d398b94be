"""Speculative decoding's decisions: when to draft, n-gram lookups, the draft model's switch."""
