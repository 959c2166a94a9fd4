"""The running system, in four rooms and one shared format (``docs/architecture.md``):

- :mod:`.protocol`: what crosses a process boundary — messages, their codec, positions, errors;
- :mod:`.control`: the controller — a pure core on a fake-able clock, its ledger and detector, the recorder,
  and the edge that drives them with sockets and timers;
- :mod:`.node`: a host — its agent, the worker processes it supervises, links, beacons, launch and preflight;
- :mod:`.worker`: a worker process — its stage, schedule, process groups and transfers;
- :mod:`.checkpoint`: checkpoints on disk — written by workers, committed by the controller, checked by preflight.
"""
