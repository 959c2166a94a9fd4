"""Functional Llama-2: configuration, parameter tree, initialisation, stage forward, Hugging Face checkpoints."""
