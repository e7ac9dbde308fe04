"""The shared-memory step channel in one process, rank 0 and a worker on two threads: every step arrives
exactly as sent (including while the worker lags and the ring is full: no slot is overwritten before it is
taken), stop arrives, a dead peer or a stuck worker makes rank 0 fail instead of waiting forever, and the
segment's name is gone once unlinked."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kiln.runtime.errors import EngineDeadError
from kiln.runtime.model_runner import BatchShape
from kiln.runtime.step_channel import StepHeader, host_views
from kiln.runtime.step_channel_shm import ShmLayout, ShmStepChannel

TOKENS, SEQS, BLOCKS = 64, 8, 6


def fake_runner() -> SimpleNamespace:
    """The host buffers a ModelRunner has, at its dtypes (what a step channel reads and writes)."""
    i64, i32 = torch.int64, torch.int32
    return SimpleNamespace(
        input_ids_cpu=torch.zeros(TOKENS, dtype=i64), positions_cpu=torch.zeros(TOKENS, dtype=i64),
        slot_mapping_cpu=torch.zeros(TOKENS, dtype=i64), query_start_loc_cpu=torch.zeros(SEQS + 1, dtype=i32),
        seq_lens_cpu=torch.zeros(SEQS, dtype=i32), block_tables_cpu=torch.zeros(SEQS, BLOCKS, dtype=i32),
        logits_indices_cpu=torch.zeros(SEQS, dtype=i64), pending_dst_cpu=torch.zeros(SEQS, dtype=i64),
        pending_src_cpu=torch.zeros(SEQS, dtype=i64), wait_host_buffers_free=lambda: None)


def random_step(runner: SimpleNamespace, gen: torch.Generator) -> tuple[StepHeader, list[torch.Tensor]]:
    """Fill rank 0's buffers with a random batch; returns its header and a copy of what it sends."""
    tokens = int(torch.randint(1, TOKENS + 1, (1,), generator=gen))
    reqs = int(torch.randint(1, SEQS + 1, (1,), generator=gen))
    blocks = int(torch.randint(1, BLOCKS + 1, (1,), generator=gen))
    pending = int(torch.randint(0, reqs + 1, (1,), generator=gen))
    for buf in vars(runner).values():
        if isinstance(buf, torch.Tensor):
            buf.copy_(torch.randint(0, 1 << 30, buf.shape, generator=gen))
    shape = BatchShape(tokens, tokens, reqs, reqs, tokens, tokens + 3, bool(tokens % 2), blocks)
    header = StepHeader(shape, pending, bool(reqs % 2), bool(blocks % 2))
    return header, [v.clone() for v in host_views(runner, shape, pending)]


def pair(**kwargs) -> tuple[ShmStepChannel, ShmStepChannel, SimpleNamespace, SimpleNamespace]:
    sender, receiver = fake_runner(), fake_runner()
    layout = ShmLayout.for_runner(sender, num_workers=1, num_slots=3)
    rank0 = ShmStepChannel.create(layout, kwargs.pop("check_workers", lambda: None), **kwargs)
    worker = ShmStepChannel.attach(rank0.name, layout, 1, os.getppid())
    return rank0, worker, sender, receiver


def test_every_step_arrives_as_sent_even_when_the_worker_lags() -> None:
    rank0, worker, sender, receiver = pair()
    sent, received = [], []

    def consume() -> None:
        while (header := worker.recv(receiver)) is not None:
            received.append((header, [v.clone() for v in host_views(receiver, header.shape, header.num_pending)]))
            if len(received) % 5 == 0:
                time.sleep(0.05)  # rank 0 fills the ring and must wait for this slot to be taken

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        header, views = random_step(sender, gen)
        rank0.send(sender, header)
        sent.append((header, views))
    rank0.send_stop()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(received) == len(sent)
    for (h0, v0), (h1, v1) in zip(sent, received):
        assert h0 == h1
        assert all(torch.equal(a, b) for a, b in zip(v0, v1))
    rank0.close()
    worker.close()


def test_rank0_waiting_on_a_full_ring_raises_when_a_worker_is_dead() -> None:
    dead = threading.Event()

    def check_workers() -> None:
        if dead.is_set():
            raise EngineDeadError("tensor-parallel worker rank 1 exited")

    rank0, worker, sender, _ = pair(check_workers=check_workers, spin_s=0.001)
    gen = torch.Generator().manual_seed(1)
    for _ in range(rank0.layout.num_slots):  # nobody takes them: the ring is now full
        rank0.send(sender, random_step(sender, gen)[0])
    threading.Timer(0.2, dead.set).start()
    with pytest.raises(EngineDeadError, match="rank 1"):
        rank0.send(sender, random_step(sender, gen)[0])
    rank0.close()
    worker.close()


def test_rank0_gives_up_on_a_worker_that_stops_taking_steps() -> None:
    rank0, worker, sender, _ = pair(spin_s=0.001, timeout_s=0.5)
    gen = torch.Generator().manual_seed(2)
    for _ in range(rank0.layout.num_slots):
        rank0.send(sender, random_step(sender, gen)[0])
    with pytest.raises(EngineDeadError, match="has not taken step 1"):
        rank0.send_stop()
    rank0.close()
    worker.close()


def test_a_worker_notices_rank0_is_gone() -> None:
    """A worker's rank 0 is its parent; here the 'parent' pid is wrong, as after rank 0 died."""
    sender, receiver = fake_runner(), fake_runner()
    layout = ShmLayout.for_runner(sender, num_workers=1)
    rank0 = ShmStepChannel.create(layout, lambda: None)
    worker = ShmStepChannel.attach(rank0.name, layout, 1, rank0_pid=os.getppid() + 1, spin_s=0.001)
    with pytest.raises(EngineDeadError, match="rank 0"):
        worker.recv(receiver)
    rank0.close()
    worker.close()


def test_a_batch_larger_than_the_slots_fails_naming_the_buffer() -> None:
    sender = fake_runner()
    rank0 = ShmStepChannel.create(ShmLayout.for_runner(sender, num_workers=1), lambda: None)
    bigger = fake_runner()
    bigger.input_ids_cpu = torch.zeros(TOKENS + 8, dtype=torch.int64)
    shape = BatchShape(TOKENS + 8, TOKENS + 8, 2, 2, 4, 4, False, 1)
    with pytest.raises(ValueError, match=f"input_ids_cpu needs {TOKENS + 8} elements, the slot holds {TOKENS}"):
        rank0.send(bigger, StepHeader(shape, 0, False))
    rank0.close()


def test_the_name_is_gone_after_unlink_and_unlinked_once() -> None:
    rank0 = ShmStepChannel.create(ShmLayout.for_runner(fake_runner(), num_workers=1), lambda: None)
    path = f"/dev/shm/{rank0.name.lstrip('/')}"
    assert os.path.exists(path)
    rank0.unlink()
    assert not os.path.exists(path)
    rank0.close()  # unlinks again only if it had not: no FileNotFoundError
