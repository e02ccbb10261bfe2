"""RankFailure: a rank died, hung past its timeout, or failed outside a step.

Its own module so that every part that calls the ranks (the executors, the state mover) can
name it: the engine loop answers it by replacing the ranks (EngineLoop._recover), and no part
may take it for an ordinary failed call and carry on over the lost rank.
"""
from __future__ import annotations


class RankFailure(RuntimeError):
    """A rank died, hung past the timeout, or failed outside a step: its ranks are replaced."""
