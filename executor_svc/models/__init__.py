"""Model implementations: the Llama family (Llama, Mistral, Qwen2, Qwen3)."""

from executor_svc.models.llama import LlamaModel

__all__ = ["LlamaModel"]
