"""From files to a model: config, checkpoint and GGUF weights, the tokenizer files, the default model."""
