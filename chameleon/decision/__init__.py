"""Decision centre: profiler, estimator (Eqs. 9–14), planner (Algorithm 1) and selector (Eq. 8).

Pure functions over plans and profiles; nothing here imports the runtime. The modules are imported
where used, so reading a config (``decision.config``) does not load the planner's solvers.
"""
