"""LoRA adapters on the executor (docs/lora.md): many adapters and the base model in one batch.

- ``errors``: what a refused adapter or registry call raises;
- ``targets``: where each PEFT module of a model family lands in the fused linear layers;
- ``peft_format``: reading PEFT's adapter_config.json and adapter_model.safetensors;
- ``adapter``: an adapter checked against the base model (``load_adapter``), in host memory;
- ``weights``: an adapter on the device, laid out per fused linear layer, scale folded in;
- ``registry``: adapters by name, resident ones (``max_loras``) and host copies, both LRU;
- ``batch``: a step's adapter segments and the deltas they add (``models.lora_hook.LoraDeltas``).
"""
