"""How many times a replica restarts its ranks before it gives up (and reports itself down, for
the deployment controller to replace): at most `limit` restarts within a sliding window, so that
ranks lost now and then over weeks never add up to a replica that stops serving, while ranks
that die again at once (a bad device, memory that runs out at every start) stop being restarted.
Only for a replica still serving: one that gave up stays down however long ago its restarts were
(the controller replaces it; RoleCoordinator._recover)."""
from __future__ import annotations


class RestartBudget:
    def __init__(self, limit: int, window_s: float):
        self.limit, self.window_s = limit, window_s
        self._at: list[float] = []  # when each restart within the window began

    def take(self, now: float) -> bool:
        """Count a restart beginning `now`; False (nothing counted) when the window is full."""
        self._at = [t for t in self._at if now - t < self.window_s]
        if len(self._at) >= self.limit:
            return False
        self._at.append(now)
        return True

    def used(self) -> int:
        return len(self._at)
