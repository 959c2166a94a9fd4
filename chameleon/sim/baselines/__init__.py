"""Other systems' recovery, modelled from their papers and artifacts for the simulator.

Each module models one system and names, in its docstring, the source of every
cost it charges and what it leaves out: :mod:`.oobleck`, :mod:`.recycle`,
:mod:`.bamboo`, :mod:`.checkpoint` (Young/Daly restart), :mod:`.torchft`,
:mod:`.elaswave` and :mod:`.failstop` (fail-slow treated as fail-stop).
"""
