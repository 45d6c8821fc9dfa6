"""Data pipeline: the mmap indexed token format, GPT-2 style samples, splits and samplers."""
