"""Functional Llama-2: configuration, parameter tree, initialisation and stage forward."""
