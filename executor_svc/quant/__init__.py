"""Quantized linear layers (``--quantization``): int8 weights quantized at load, GGUF blocks kept as stored.

- ``modes``: the modes by name and the effective ``Quantization`` of an executor;
- ``layer_ops``: ``QuantizedLayerOps``, the layer ops the model is built with
  when a mode is on (its ``pack`` quantizes each linear weight);
- ``int8``: per-channel int8 weights with dynamic int8 activations, and the
  torch code that is both the fallback and the tests' reference.

See docs/quantization.md.
"""
