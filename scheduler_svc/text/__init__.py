"""Text in and out: the tokenizer and chat template, incremental detokenization, stop strings, and each request's
stream of text deltas (output_processor)."""
