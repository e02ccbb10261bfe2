"""A replica's rank restarts count within a sliding window: ranks lost now and then never add up
to a replica that gives up; ranks that die again at once do."""
from hyrax.actors.restart_budget import RestartBudget


def test_restarts_within_the_window_are_limited_and_old_ones_stop_counting():
    b = RestartBudget(limit=3, window_s=600.0)
    assert [b.take(t) for t in (0.0, 10.0, 20.0)] == [True, True, True]
    assert not b.take(30.0) and b.used() == 3  # a refusal is not counted
    assert b.take(600.0) and b.used() == 3  # the first has left the window
    assert not b.take(601.0)


def test_a_restart_now_and_then_never_runs_out():
    b = RestartBudget(limit=3, window_s=600.0)
    assert all(b.take(day * 86400.0) for day in range(30))
    assert b.used() == 1


def test_no_restarts_allowed_means_none():
    assert not RestartBudget(limit=0, window_s=600.0).take(0.0)
