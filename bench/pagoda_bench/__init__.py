"""``pagoda bench``: a ``vllm bench serve``-style load generator with a Hugging Face baseline.

Kept out of ``pagoda_client`` because the baseline needs torch and transformers
(imported lazily, only by ``backend_hf``) and the charts need matplotlib.
"""
