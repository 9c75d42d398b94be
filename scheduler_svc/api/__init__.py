"""The client API's edges: the gRPC servicer and its conversions, the OpenAI-compatible HTTP API, API keys, and the
checks every request passes whichever edge it came by (validation)."""
