"""Chameleon: adaptive fault tolerance for distributed LLM training."""

__version__ = "0.1.0"
