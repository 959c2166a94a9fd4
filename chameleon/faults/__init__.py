"""Fault injection: what to inject (:mod:`.spec`, pure and checked with the config) and how it is fired (:mod:`.inject`)."""
