"""Hugging Face `transformers` interop: a TokenFormer checkpoint as a model directory that
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` loads, and back (docs/inference.md,
"Use with transformers").

`configuration_tokenformer.py` and `modeling_tokenformer.py` are the two files copied into every such directory:
they import torch and transformers only. megatron/formats/huggingface.py converts names, config and files in both
directions without importing transformers, so the tools run on the core install. Nothing is imported here, so
that importing `megatron.formats.huggingface` never needs transformers.
"""
