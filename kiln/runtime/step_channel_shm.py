"""The step channel of a single host: a ring of slots in one shared-memory segment.

Why: rank 0's host is the bottleneck of a tensor-parallel step (its GPU idles between steps), and two gloo
broadcasts over TCP cost it 0.6-1.0 ms per step (profile in docs/distributed.md). Here a send is a few
memcpys into shared memory and one store of a sequence number; a worker polls that number.

Layout: a control block (rank 0's published sequence number, then one acknowledged sequence number per
worker, each on its own 64-byte line so no two writers share a cache line), then `num_slots` slots, each a
header of HEADER_LEN int64 and one segment per host buffer sized for the whole buffer (so any batch the
runner can hold fits; the bound is checked on send all the same). Step `seq` goes into slot `seq %
num_slots`; rank 0 reuses a slot only once every worker acknowledged the step that used it before, and a
worker acknowledges only after it copied the step out. Rank 0 writes the slot, then the sequence number;
a worker reads the number, then the slot: a lock acquire/release between the two (a full barrier on every
platform CPython runs on) keeps those orders on weakly ordered CPUs too.

Waiting: spin (yielding the core to any other runnable thread) for `spin_s`, then sleep with a doubling
back-off up to `max_sleep_s`, so an idle server does not burn a core. While sleeping the waiter calls
`check_peer`: rank 0's raises EngineDeadError naming a dead worker; a worker's notices rank 0 is gone
(it is the worker's parent) and raises, so the worker exits. Rank 0 also gives up after `timeout_s`.

The segment's name lives only as long as the set-up: rank 0 unlinks it once every worker has mapped it,
so nothing is left in /dev/shm however the processes end later (the mappings stay valid until closed).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np
import torch

from kiln.runtime.errors import EngineDeadError
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.step_channel import (
    HEADER_LEN,
    HOST_BUFFERS,
    StepChannel,
    StepHeader,
    decode_header,
    encode_header,
    step_slices,
)

_LINE = 64  # bytes: one cache line per writer in the control block
_FENCE = threading.Lock()


def _fence() -> None:
    with _FENCE:  # acquiring and releasing a mutex orders the memory accesses around it
        pass


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _LINE) * _LINE


@dataclasses.dataclass(frozen=True)
class ShmLayout:
    """What both sides need to map the segment: sent from rank 0 to the workers at set-up."""

    num_workers: int
    num_slots: int
    buffers: tuple[tuple[str, int], ...]  # (dtype name, capacity in elements) per HOST_BUFFERS entry

    @classmethod
    def for_runner(cls, runner: ModelRunner, num_workers: int, num_slots: int = 4) -> ShmLayout:
        buffers = tuple((str(getattr(runner, name).dtype).removeprefix("torch."), getattr(runner, name).numel())
                        for name in HOST_BUFFERS)
        return cls(num_workers, num_slots, buffers)

    @property
    def control_bytes(self) -> int:
        return _LINE * (1 + self.num_workers)

    def segment_bytes(self) -> list[int]:
        return [_aligned(HEADER_LEN * 8)] + [_aligned(n * getattr(torch, d).itemsize) for d, n in self.buffers]

    @property
    def slot_bytes(self) -> int:
        return sum(self.segment_bytes())

    @property
    def total_bytes(self) -> int:
        return self.control_bytes + self.num_slots * self.slot_bytes


def wait_until(ready: Callable[[], bool], check_peer: Callable[[], None], spin_s: float, max_sleep_s: float,
               timeout_s: float | None, what: str) -> None:
    if ready():
        return
    start = time.perf_counter()
    while time.perf_counter() - start < spin_s:
        if ready():
            return
        os.sched_yield()
    sleep = 20e-6
    while not ready():
        check_peer()
        if timeout_s is not None and time.perf_counter() - start > timeout_s:
            raise EngineDeadError(f"tensor-parallel step channel: {what} for {timeout_s:.0f} s; the engine has stopped")
        time.sleep(sleep)
        sleep = min(sleep * 2, max_sleep_s)


class ShmStepChannel(StepChannel):
    """One end of the ring: rank 0's (`create`) or worker `rank`'s (`attach`)."""

    kind = "shm"

    def __init__(self, shm: shared_memory.SharedMemory, layout: ShmLayout, rank: int, owner: bool,
                 check_peer: Callable[[], None], device_group=None, spin_s: float = 0.002,
                 max_sleep_s: float = 0.001, timeout_s: float | None = None) -> None:
        super().__init__(device_group)
        if shm.size < layout.total_bytes:
            raise ValueError(f"shared-memory segment {shm.name} has {shm.size} bytes, the layout needs "
                             f"{layout.total_bytes}")
        self.shm, self.layout, self.rank, self.owner = shm, layout, rank, owner
        self.check_peer, self.spin_s, self.max_sleep_s, self.timeout_s = check_peer, spin_s, max_sleep_s, timeout_s
        self._unlinked = not owner
        words = layout.control_bytes // 8
        control = np.frombuffer(shm.buf, dtype=np.int64, count=words)
        self._published = control[0:1]
        self._acks = control[_LINE // 8::_LINE // 8]  # one word per worker, a line apart
        self._headers: list[np.ndarray] = []
        self._segments: list[list[np.ndarray]] = []
        self._runner_arrays: tuple[object, list[np.ndarray]] | None = None
        offset = layout.control_bytes
        for _ in range(layout.num_slots):
            sizes = layout.segment_bytes()
            self._headers.append(np.frombuffer(shm.buf, dtype=np.int64, count=HEADER_LEN, offset=offset))
            at = offset + sizes[0]
            segments = []
            for (dtype, capacity), nbytes in zip(layout.buffers, sizes[1:]):
                segments.append(np.frombuffer(shm.buf, dtype=np.dtype(dtype), count=capacity, offset=at))
                at += nbytes
            self._segments.append(segments)
            offset += layout.slot_bytes
        self._seq = int(self._published[0]) if owner else int(self._acks[rank - 1])

    # -- set-up ----------------------------------------------------------------------------------------
    @classmethod
    def create(cls, layout: ShmLayout, check_workers: Callable[[], None], **kwargs) -> ShmStepChannel:
        """Rank 0's end: a new zeroed segment (its name is `name`, to send to the workers)."""
        name = f"kiln-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=layout.total_bytes)
        try:
            return cls(shm, layout, 0, True, check_workers, **kwargs)
        except BaseException:
            shm.close()
            shm.unlink()
            raise

    @classmethod
    def attach(cls, name: str, layout: ShmLayout, rank: int, rank0_pid: int, **kwargs) -> ShmStepChannel:
        """Worker `rank`'s end. Rank 0 is this process's parent (kiln spawned it): when the parent changes,
        rank 0 is gone."""

        def check_rank0() -> None:
            if os.getppid() != rank0_pid:
                raise EngineDeadError(f"tensor-parallel rank 0 (pid {rank0_pid}) exited; worker rank {rank} stops")

        # spawned workers share rank 0's resource tracker, which forgets the name when rank 0 unlinks it
        shm = shared_memory.SharedMemory(name=name)
        try:
            return cls(shm, layout, rank, False, check_rank0, **kwargs)
        except BaseException:
            shm.close()
            raise

    @property
    def name(self) -> str:
        return self.shm.name

    def unlink(self) -> None:
        """Remove the segment's name (rank 0, once every worker mapped it); the mappings stay valid."""
        if not self._unlinked:
            self._unlinked = True
            self.shm.unlink()

    def close(self) -> None:
        self.unlink()
        self._headers, self._segments, self._runner_arrays = [], [], None
        self._published = self._acks = None
        try:
            self.shm.close()
        except BufferError:  # a view of it is still referenced somewhere: the mapping goes with the process
            pass

    # -- rank 0 ----------------------------------------------------------------------------------------
    def _arrays(self, runner: ModelRunner) -> list[np.ndarray]:
        """Numpy views of the runner's host buffers, made once: numpy slicing and copies cost a fraction of
        torch's per call, and a step makes about twenty of them."""
        if self._runner_arrays is None or self._runner_arrays[0] is not runner:
            self._runner_arrays = (runner, [getattr(runner, name).numpy() for name in HOST_BUFFERS])
        return self._runner_arrays[1]

    def _publish(self, values: list[int], views: list[np.ndarray]) -> None:
        seq = self._seq + 1
        reuse = seq - self.layout.num_slots  # the step that used this slot before
        wait_until(lambda: int(self._acks.min()) >= reuse, self.check_peer, self.spin_s, self.max_sleep_s,
                   self.timeout_s, f"a worker has not taken step {reuse}")
        slot = seq % self.layout.num_slots
        self._headers[slot][:] = values
        for segment, view in zip(self._segments[slot], views):
            segment[: view.size].reshape(view.shape)[...] = view
        _fence()
        self._published[0] = seq
        self._seq = seq

    def send(self, runner: ModelRunner, header: StepHeader) -> None:
        views = step_slices(self._arrays(runner), header.shape, header.num_pending)
        for name, view, (_, capacity) in zip(HOST_BUFFERS, views, self.layout.buffers):
            if view.size > capacity:
                raise ValueError(f"step batch does not fit the shared-memory step channel: {name} needs "
                                 f"{view.size} elements, the slot holds {capacity}")
        self._publish(encode_header(header), views)

    def send_stop(self) -> None:
        self._publish([0] * HEADER_LEN, [])

    # -- a worker --------------------------------------------------------------------------------------
    def recv(self, runner: ModelRunner) -> StepHeader | None:
        seq = self._seq + 1
        wait_until(lambda: int(self._published[0]) >= seq, self.check_peer, self.spin_s, self.max_sleep_s, None,
                   f"step {seq} not published")
        _fence()
        slot = seq % self.layout.num_slots
        header = decode_header(self._headers[slot].tolist())
        if header is not None:
            runner.wait_host_buffers_free()  # the previous step's non-blocking uploads read them
            views = step_slices(self._arrays(runner), header.shape, header.num_pending)
            for segment, view in zip(self._segments[slot], views):
                view[...] = segment[: view.size].reshape(view.shape)
        _fence()
        self._acks[self.rank - 1] = seq
        self._seq = seq
        return header
