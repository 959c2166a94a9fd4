"""Run outputs: per-step metrics, events, the summary, and plots."""
