"""One executor's scheduler core: its sequences, waiting queue, step plans and what came of them."""
