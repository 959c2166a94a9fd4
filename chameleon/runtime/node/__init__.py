"""A host: its agent, the worker processes it supervises, its links to the controller, launch and preflight."""
