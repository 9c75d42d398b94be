"""Choosing tokens from logits: the batched sampler, its kernels, prompt logprobs, output constraints."""
