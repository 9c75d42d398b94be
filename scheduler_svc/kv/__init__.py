"""KV blocks as metadata: the block pool, block tables with the prefix cache, the offload tier's index."""
