"""A worker process: its stage, 1F1B schedule, per-generation process groups, transfers and device."""
