"""Functional decoders (Llama 2 and 3, GPT-2-style): configuration, parameters, forward, Hugging Face checkpoints."""
