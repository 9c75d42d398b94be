"""The KV cache on the device, and the offload tier behind it."""
