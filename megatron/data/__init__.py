"""Data pipeline: corpus reading and tokenizing, the mmap indexed format, GPT-2 samples, blends, splits, samplers."""
