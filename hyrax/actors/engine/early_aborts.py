"""Aborts that arrive before the request they name.

Over Ray, a replica's coordinator is an async actor, and an async actor does not promise to
run one caller's calls in the order they were sent: a gateway whose client vanished right
after it asked a replica to start (or import) a request can have its abort run first. The
abort finds nothing; the start then runs a request nobody will read, to its last token.

So an abort for an unknown id is remembered for a while, and a start or import of that id
within that time is refused (the stream ends with `finish_reason` "abort")."""
from __future__ import annotations

import time


class EarlyAborts:
    def __init__(self, keep_s: float = 60.0, limit: int = 100_000):
        self.keep_s, self.limit = keep_s, limit
        self._until: dict[str, float] = {}  # request id -> when to forget it (monotonic)
        self.refused = 0  # starts and imports refused because their abort came first

    def remember(self, request_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if len(self._until) >= self.limit or (self._until and next(iter(self._until.values())) <= now):
            self._until = {k: t for k, t in self._until.items() if t > now}  # forget the expired
            while len(self._until) >= self.limit:  # still full: forget the oldest
                self._until.pop(next(iter(self._until)))
        self._until[request_id] = now + self.keep_s

    def take(self, request_id: str, now: float | None = None) -> bool:
        """Whether `request_id` was aborted before it arrived (and forget it)."""
        until = self._until.pop(request_id, None)
        hit = until is not None and until > (time.monotonic() if now is None else now)
        self.refused += hit
        return hit

    def __len__(self) -> int:
        return len(self._until)
