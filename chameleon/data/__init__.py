"""Real text, a byte-level tokenizer, and the deterministic global sample stream."""
