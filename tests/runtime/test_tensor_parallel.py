"""Tensor parallelism over gloo on CPU: 2 ranks give the same greedy tokens as 1 (sync and async scheduling;
the shared-memory step channel, the default for spawned workers, and the gloo one), shut down without hanging
or leaving a shared-memory segment behind, fail at once, naming the cause, when a worker cannot start or
dies, and a worker leaves when rank 0 dies."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from kiln import Runtime, SamplingParams
from kiln.runtime.distributed import EngineDeadError
from tests.conftest import random_prompts

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts([5, 17, 40, 3, 26], 256, seed=21)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [o.outputs[0].token_ids for o in Runtime("tiny-qwen3", level=0, device="cpu").generate(PROMPTS, PARAMS)]


def test_tp2_gloo_step_channel_matches_tp1(reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """The channel torchrun (multi-host) launches use, forced on spawned workers; async scheduling on, so the
    sampled ids travel over the device group next to it."""
    monkeypatch.setenv("KILN_TP_STEP_CHANNEL", "gloo")
    runtime = Runtime("tiny-qwen3", level=0, device="cpu", tensor_parallel_size=2, max_num_batched_tokens=32,
                      async_scheduling=True)
    try:
        assert runtime.engine.tp.channel.kind == "gloo"
        assert [o.outputs[0].token_ids for o in runtime.generate(PROMPTS, PARAMS)] == reference
    finally:
        runtime.engine.shutdown()


def test_tp2_falls_back_to_gloo_without_room_in_dev_shm(reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """A segment tmpfs cannot back would SIGBUS mid-step: rank 0 checks first and the workers follow its
    choice (they are never left waiting for an offer)."""
    import kiln.runtime.distributed as tp

    def no_room(nbytes: int) -> None:
        raise OSError(f"/dev/shm has 0 bytes free, the step channel needs {nbytes}")

    monkeypatch.setattr(tp, "_check_shm_space", no_room)
    runtime = Runtime("tiny-qwen3", level=0, device="cpu", tensor_parallel_size=2, max_num_batched_tokens=32)
    try:
        assert runtime.engine.tp.channel.kind == "gloo"
        assert [o.outputs[0].token_ids for o in runtime.generate(PROMPTS, PARAMS)] == reference
    finally:
        runtime.engine.shutdown()


def own_shm_segments() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"kiln-tp-{os.getpid()}-")]


def test_shm_step_channel_leaves_no_segment_behind() -> None:
    """Rank 0 unlinks the segment's name as soon as every worker mapped it: none exists while serving (so a
    crash cannot leak one either), and none after shutdown; the workers still get every step."""
    assert own_shm_segments() == []
    runtime = Runtime("tiny-qwen3", level=0, device="cpu", tensor_parallel_size=2)
    try:
        channel = runtime.engine.tp.channel
        assert channel.kind == "shm" and channel.name.lstrip("/").startswith(f"kiln-tp-{os.getpid()}-")
        assert own_shm_segments() == []
        assert len(runtime.generate(PROMPTS[:2], PARAMS)[1].outputs[0].token_ids) == PARAMS.max_tokens
    finally:
        runtime.engine.shutdown()
    assert own_shm_segments() == []
    assert runtime.engine.tp.procs[0].exitcode == 0


def test_worker_exits_when_rank0_is_killed(tmp_path: Path) -> None:
    """Rank 0 dies without shutting down (SIGKILL): its worker, waiting for the next step, must leave."""
    import signal
    import time

    script = tmp_path / "rank0_dies.py"
    script.write_text(textwrap.dedent("""
        import os, signal
        from kiln import Runtime, SamplingParams

        if __name__ == "__main__":
            runtime = Runtime("tiny-qwen3", level=0, device="cpu", tensor_parallel_size=2)
            runtime.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
            print("worker", runtime.engine.tp.procs[0].pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """))
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(root)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:  # files, not pipes: the worker inherits them
        returncode = subprocess.run([sys.executable, str(script)], env=env, stdout=stdout, stderr=stderr,
                                    timeout=300).returncode
    assert returncode == -signal.SIGKILL, err.read_text()[-3000:]
    pid = int(out.read_text().split("worker")[-1].split()[0])

    def alive() -> bool:  # an orphan that exited may stay a zombie until its new parent reaps it
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 60  # a bound against a hang, not a measurement
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive():
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"worker {pid} still running 60 s after rank 0 was killed")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_greedy_ids_per_rank_and_gathered_logits_agree(reference, async_scheduling: bool) -> None:
    """Two ways to a step's tokens under TP, both equal to TP=1. All-greedy batches: each rank takes the argmax
    of its own vocabulary shard and one all-gather of (value, id) picks the winner on every rank (no logits
    gather, no broadcast). A batch with a request that wants logprobs: the logits are gathered to rank 0,
    which samples and (overlapped steps) broadcasts the ids; each step's pending input tokens reach the worker
    either way and are put into its input_ids in place exactly as on rank 0."""
    scored = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    # one rank's, built first: kiln's tensor-parallel state is per process
    alone = Runtime("tiny-qwen3", level=0, device="cpu", max_num_batched_tokens=32).generate(PROMPTS[1:2], scored)
    runtime = Runtime("tiny-qwen3", level=0, device="cpu", tensor_parallel_size=2, max_num_batched_tokens=32,
                      async_scheduling=async_scheduling)
    model = runtime.engine.runner.model
    calls: list[int] = []
    greedy_tokens = model.greedy_tokens
    model.greedy_tokens = lambda hidden: calls.append(hidden.shape[0]) or greedy_tokens(hidden)
    try:
        assert runtime.engine.tp.channel.kind == "shm"  # kiln spawned the worker on this host
        assert runtime.engine.kv_cache.shape[-2] == 1  # tiny-qwen3's 2 KV heads: one per rank
        assert [o.outputs[0].token_ids for o in runtime.generate(PROMPTS, PARAMS)] == reference
        assert calls  # the per-rank argmax served those steps
        calls.clear()
        wants_logprobs = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
        outs = runtime.generate(PROMPTS, [wants_logprobs] + [PARAMS] * (len(PROMPTS) - 1))
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert len(outs[0].outputs[0].logprobs) == 8 and not calls  # every step held the logprobs request
        # prompt logprobs: their chunks' logits rows beside the sampling ones, on every rank alike
        outs = runtime.generate(PROMPTS[1:3], [scored, PARAMS])
        assert [o.outputs[0].token_ids for o in outs] == reference[1:3]
        assert len(outs[0].prompt_logprobs) == len(PROMPTS[1]) and outs[1].prompt_logprobs is None
        for got, want in zip(outs[0].prompt_logprobs[1:], alone[0].prompt_logprobs[1:]):
            assert got.sampled.token_id == want.sampled.token_id and got.sampled.rank == want.sampled.rank
            assert got.sampled.logprob == pytest.approx(want.sampled.logprob, abs=1e-4)
        if async_scheduling:
            assert runtime.engine.stats.overlapped_steps > 0
    finally:
        runtime.engine.shutdown()


def test_tp2_shutdown_returns_and_every_rank_exits() -> None:
    """Shutdown must neither hang (it runs on a thread here, so a hang fails the test instead of the run) nor
    leave a worker behind; the workers leave by themselves (exit code 0, not terminated), and rank 0's own
    process group is gone, so a new tensor-parallel runtime can be built in this process."""
    import torch.distributed as dist

    from kiln.models.parallel import tp_size

    runtime = Runtime("tiny-qwen3", level=0, device="cpu", tensor_parallel_size=2)
    runtime.generate(PROMPTS[:2], PARAMS)
    procs = list(runtime.engine.tp.procs)
    stopper = threading.Thread(target=runtime.engine.shutdown, daemon=True)
    stopper.start()
    stopper.join(timeout=120)
    assert not stopper.is_alive(), "Engine.shutdown() did not return"
    assert [p.is_alive() for p in procs] == [False]
    assert [p.exitcode for p in procs] == [0]
    assert not dist.is_initialized() and tp_size() == 1


def test_unguarded_script_builds_and_exits(reference, tmp_path: Path) -> None:
    """The worker starts from kiln's own entry point, so a script without `if __name__ == "__main__":` runs once:
    it builds, generates the same tokens as in-process TP=1 and exits without a shutdown, printing no traceback;
    its worker does not outlive it (terminated at rank 0's exit)."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        import json
        from kiln import Runtime, SamplingParams

        print("script body", flush=True)
        runtime = Runtime("tiny-qwen3", level=0, device="cpu", tensor_parallel_size=2)
        outs = runtime.generate({PROMPTS[:2]!r}, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        print(json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
        print("worker", runtime.engine.tp.procs[0].pid, flush=True)
    """))
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "KILN_TP_TIMEOUT")}
    env["PYTHONPATH"] = str(root)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "script body" and lines.count("script body") == 1, proc.stdout
    assert json.loads(lines[1]) == reference[:2]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    pid = int(lines[2].split()[1])
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


@pytest.mark.slow
def test_tp2_matches_tp1_at_o2(reference) -> None:
    """The row-parallel all-reduces are traced into the compiled pieces (functional collectives over gloo)."""
    runtime = Runtime("tiny-qwen3", level=2, compile_sizes=(), device="cpu", tensor_parallel_size=2,
                      max_num_batched_tokens=64)
    try:
        assert [o.outputs[0].token_ids for o in runtime.generate(PROMPTS, PARAMS)] == reference
        stats = runtime.compile_stats
        assert stats.dynamo_traces == 1 and stats.compiles_after_warmup == 0
    finally:
        runtime.engine.shutdown()


def test_torchrun_style_launch_uses_the_same_entry_point(reference) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).with_name("tp_entry.py")
    root = Path(__file__).resolve().parents[2]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(root)}
        procs.append(subprocess.Popen([sys.executable, str(script), json.dumps(PROMPTS)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert json.loads(outs[0][0].strip().splitlines()[-1]) == reference


def test_dead_worker_stops_the_engine_with_a_clear_error() -> None:
    runtime = Runtime("tiny-qwen3", level=0, device="cpu", tensor_parallel_size=2)
    try:
        runtime.engine.tp.procs[0].kill()
        runtime.engine.tp.procs[0].join(timeout=30)
        with pytest.raises(EngineDeadError, match="rank 1"):
            runtime.generate(PROMPTS[:1], PARAMS)
    finally:
        runtime.engine.shutdown()


def test_a_worker_that_dies_before_its_hello_fails_the_start_at_once() -> None:
    """Rank 0 must not go on to the rendezvous (which waits for every rank until KILN_TP_TIMEOUT) with a dead peer."""
    import time

    from kiln.runtime.tp_processes import LocalWorkers, WorkerStartError, wait_until_started

    class DiedAtImport:
        exitcode = 1

        def wait_ready(self, timeout: float) -> bool:
            return False

        def is_alive(self) -> bool:
            return False

        def join(self, timeout: float) -> None:
            pass

    start = time.monotonic()
    with pytest.raises(WorkerStartError, match=r"rank 1 exited \(code 1\) before it started"):
        wait_until_started(LocalWorkers([DiedAtImport()]), timeout=300)
    assert time.monotonic() - start < 60  # not the timeout


def test_start_up_watch_reports_a_worker_that_died(caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0 would otherwise wait in a collective until the group times out, with no hint of why."""
    import logging
    import threading
    import time

    from kiln.runtime.tp_processes import watch_start_up

    class DeadWorker:
        exitcode = 7

        def is_alive(self) -> bool:
            return False

    ready = threading.Event()
    with caplog.at_level(logging.ERROR, logger="kiln"):
        watch_start_up([DeadWorker()], ready)
        deadline = time.monotonic() + 10
        while "exited during start-up" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.1)
    ready.set()
    assert "worker rank 1 exited during start-up (code 7)" in caplog.text


def test_fp8_tp2_matches_tp1() -> None:
    """FP8 scales shard with their weights: column-parallel ranks keep their channels' scales, row-parallel
    ranks the whole vector (quantized before sharding, so the scales are TP=1's exactly). The per-token
    activation scale of a row-parallel input spans each rank's slice only, which moves the logits by FP8
    rounding; greedy tokens on these prompts are unchanged (measured: all equal)."""
    tp1 = Runtime("tiny-qwen3", level=0, device="cpu", quantization="fp8")
    down = tp1.engine.model.layers[0].mlp.down_proj
    assert down.weight.shape == (64, 128) and down.weight_scale.shape == (64,)
    reference = [o.outputs[0].token_ids for o in tp1.generate(PROMPTS, PARAMS)]
    runtime = Runtime("tiny-qwen3", level=0, device="cpu", tensor_parallel_size=2, max_num_batched_tokens=32,
                      quantization="fp8")
    try:
        down2 = runtime.engine.model.layers[0].mlp.down_proj  # rank 0's shard
        assert down2.weight.shape == (64, 64) and torch.equal(down2.weight_scale, down.weight_scale)
        gate_up = runtime.engine.model.layers[0].mlp.gate_up_proj
        full = tp1.engine.model.layers[0].mlp.gate_up_proj.weight_scale
        assert torch.equal(gate_up.weight_scale, torch.cat([full[:64], full[128:192]]))  # gate, up: first halves
        assert [o.outputs[0].token_ids for o in runtime.generate(PROMPTS, PARAMS)] == reference
    finally:
        runtime.engine.shutdown()
