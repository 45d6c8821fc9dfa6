"""TokenFormer pretraining framework (GPT-NeoX-style) on PyTorch and DeepSpeed."""
