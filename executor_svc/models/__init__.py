"""Model families, by Hugging Face architecture (see ``registry``).

A new family is one module (like ``llama``) plus its entries in ``FAMILIES``.
"""

from executor_svc.models import gemma, llama, mixtral, olmoe, phi3, qwen3_moe
from executor_svc.models.registry import (
    DecoderModel,
    GgufSpec,
    ModelFamily,
    family_for_config,
    family_for_gguf,
    get_model_family,
    register_model,
    supported_architectures,
)

# Registered in this order; supported_architectures() lists them so.
FAMILIES: tuple[ModelFamily, ...] = (
    llama.FAMILIES + gemma.FAMILIES + phi3.FAMILIES + mixtral.FAMILIES + qwen3_moe.FAMILIES + olmoe.FAMILIES
)
for _family in FAMILIES:
    register_model(_family)

__all__ = [
    "FAMILIES",
    "DecoderModel",
    "GgufSpec",
    "ModelFamily",
    "family_for_config",
    "family_for_gguf",
    "get_model_family",
    "register_model",
    "supported_architectures",
]
