"""A migration whose export call fails (RayBackend.run timing out, a rank failing during the
export) leaves no target behind: the request can be migrated again. The target used to stay
recorded, and every later migration of the request answered `not_running` until its stream
ended."""
from __future__ import annotations

import asyncio

import pytest

from hyrax.actors.engine.commands import MigrateOut
from hyrax.actors.engine.lifecycle import Outcome
from hyrax.api.client import EngineClient, ModelInfo


class Replica:
    """Answers MigrateOut with the next of `answers` (an exception is raised)."""

    role = "colocated"

    def __init__(self, index: int, answers: list):
        self.index, self.answers = index, answers

    async def run(self, cmd):
        assert isinstance(cmd, MigrateOut), cmd
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


def test_a_migration_whose_export_call_fails_can_be_tried_again():
    src, dst = Replica(0, [TimeoutError("no answer"), True]), Replica(1, [])
    client = EngineClient(ModelInfo("m", 64, None, None, 8), [src, dst])
    client.owner["r"] = src

    async def twice():
        with pytest.raises(TimeoutError):
            await client.migrate("r")
        assert "r" not in client.migrate_to
        return await client.migrate("r", wait_s=0)  # the target, not where it went: these replicas list nothing

    assert asyncio.run(twice()) == (Outcome.MIGRATING, dst)
    assert client.migrate_to == {"r": dst}
