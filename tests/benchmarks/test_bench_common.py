"""benchmarks.common's decode timing: the host's share of a step is the step less its waits for the device."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from benchmarks.common import decode_step_timing
from kiln.runtime.async_step import DeviceEvent

HOST_S, DEVICE_S = 0.002, 0.006


class _Engine:
    """Steps that work on the host for HOST_S, then wait DEVICE_S on a device event (patched to sleep)."""

    def __init__(self) -> None:
        self.loaded = SimpleNamespace(spec=SimpleNamespace(vocab_size=100))
        self.scheduler = SimpleNamespace(waiting=[], running=[])
        self.steps = 0

    def add_request(self, prompt: list[int], params: object) -> None:
        pass

    def has_unfinished(self) -> bool:
        return False

    def step(self) -> None:
        self.steps += 1
        end = time.perf_counter() + HOST_S
        while time.perf_counter() < end:  # busy, as host work is
            pass
        DeviceEvent(torch.device("cpu")).synchronize()


def test_host_time_excludes_the_waits_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    def sleep(event: DeviceEvent) -> None:
        time.sleep(DEVICE_S)

    monkeypatch.setattr(DeviceEvent, "synchronize", sleep)
    engine = _Engine()
    step, host = decode_step_timing(engine, batch=1, prompt_len=4, steps=8)
    assert engine.steps == 10  # two untimed steps, then the timed ones
    assert step >= HOST_S + DEVICE_S
    assert HOST_S <= host < HOST_S + DEVICE_S / 2  # the sleeps are not the host's
    assert DeviceEvent.synchronize is sleep  # the timing wrapper is gone again
