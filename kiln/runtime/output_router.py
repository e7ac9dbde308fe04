"""Each caller of a Runtime gets its own requests' outputs.

`Engine.step()` advances every request in the batch and returns all of their outputs, while a Runtime may have
several callers at once: a `stream()` left open while `generate()` runs, or calls from several threads. Whoever
steps must not consume another caller's outputs (a stream then lost tokens, or waited forever for a final output
a `generate()` had swallowed), and two threads must not step the engine at the same time (its batch state is not
shared-safe). So one lock serialises the engine, every request gets a mailbox when it is added, each step's
outputs go to the mailboxes of the requests they belong to, and each caller reads only its own.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from kiln.runtime.engine import Engine
from kiln.runtime.outputs import RequestOutput


class OutputRouter:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._mailboxes: dict[str, deque[RequestOutput]] = {}

    def add(self, prompt: Any, params: Any, final_only: bool = False) -> str:
        """Engine.add_request under the lock, with a mailbox for the request's outputs."""
        with self._lock:
            request_id = self.engine.add_request(prompt, params, final_only=final_only)
            self._mailboxes[request_id] = deque()
            return request_id

    def take(self, request_id: str) -> list[RequestOutput]:
        """The request's outputs since the last take, stepping the engine until there is at least one (the lock
        is let go between steps, so another thread's requests join the next batch)."""
        while True:
            with self._lock:
                mailbox = self._mailboxes[request_id]
                if mailbox:
                    outputs = list(mailbox)
                    mailbox.clear()
                    return outputs
                for out in self.engine.step():
                    owner = self._mailboxes.get(out.request_id)
                    if owner is not None:
                        owner.append(out)

    def release(self, request_ids: list[str]) -> None:
        """The caller is done with these requests: aborted if still running (their KV blocks freed at once; a
        no-op once finished), their mailboxes dropped."""
        with self._lock:
            for request_id in request_ids:
                self.engine.abort(request_id)
                self._mailboxes.pop(request_id, None)
