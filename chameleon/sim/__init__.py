"""Discrete-event simulation of long runs on large clusters, driving the real decision centre."""
