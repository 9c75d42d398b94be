"""The client API's edges: the gRPC servicer and its conversions, the OpenAI-compatible HTTP API, API keys."""
