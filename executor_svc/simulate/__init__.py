"""The simulated executor (--simulate): a cost-model runner, its fitted step time, its tokenizer."""
