"""What a launched step leaves behind until the engine processes it: its sampled tokens, on their way to the host.

With overlapped ("async") scheduling the engine launches step k and only then processes step k-1, so
nothing on the launch path may wait for the device. The sampled token ids stay on the device (step k reads
them there), and a non-blocking copy brings them into a pinned host buffer, with an event that says when
they have landed. Two buffers alternate: step k+1's copy may be queued while step k-1's values are still
being read. On CPU every copy is synchronous and the events are no-ops, so the same code runs there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.runtime.outputs import TokenLogprobs
from kiln.runtime.scheduler import SchedulerOutput


class DeviceEvent:
    """A CUDA event on the current stream, or nothing on CPU (where work is done when the call returns)."""

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event() if device.type == "cuda" else None

    def record(self) -> None:
        if self._event is not None:
            self._event.record()

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; its tokens are read by `token_ids()`."""

    sched: SchedulerOutput
    rows: list[int]  # scheduler indices of the requests that sampled, in token order
    logprobs: list[TokenLogprobs | None]
    host_tokens: torch.Tensor | None = None  # pinned destination of the device->host copy
    landed: DeviceEvent | None = None  # recorded after that copy
    needs_drain: bool = False  # the next step must not launch before these tokens are on the host
    # a speculative verify step: row -> (proposals verified, proposals accepted); its rows repeat per token
    verified: dict[int, tuple[int, int]] = field(default_factory=dict)
    # prompt logprobs scored this step: row -> (the first prompt position scored, its entries and the next ones')
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    _token_ids: list[int] | None = field(default=None, repr=False)

    def token_ids(self) -> list[int]:
        """Wait for this step's tokens (only this step's: later launches keep running) and read them."""
        if self._token_ids is None:
            if self.landed is not None:
                self.landed.synchronize()
            self._token_ids = self.host_tokens.tolist() if self.host_tokens is not None else []
        return self._token_ids


class TokenReadback:
    """Non-blocking device->host copies of sampled token ids into two alternating pinned buffers."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self._buffers = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._events = [DeviceEvent(device) for _ in range(2)]
        self._next = 0

    def start(self, tokens: torch.Tensor) -> tuple[torch.Tensor, DeviceEvent]:
        # Buffer i is reused two launches later; by then the engine has read it (it processes step k-1 before
        # launching step k+1), so no extra wait is needed.
        host, event = self._buffers[self._next][: tokens.numel()], self._events[self._next]
        self._next ^= 1
        host.copy_(tokens, non_blocking=tokens.device.type == "cuda")
        event.record()
        return host, event
