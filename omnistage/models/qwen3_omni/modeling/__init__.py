"""Qwen3-Omni modeling: our own PyTorch modules loading the Hugging Face layout."""
