"""The commands: `kiln serve` as a real process (start-up summary, SIGTERM drain), `kiln bench serve` against
it, `kiln bench throughput` offline, and `kiln chat` (history, commands, local and remote)."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kiln.entrypoints.cli.main import main
from kiln.runtime.startup import PHASES

pytestmark = pytest.mark.slow


class ServeProcess:
    def __init__(self, model_dir: Path, log: Path) -> None:
        cmd = [sys.executable, "-m", "kiln", "serve", str(model_dir), "-O0", "--device", "cpu", "--port", "0",
               "--kv-cache-bytes", str(128 << 20), "--no-progress", "--no-access-log", "--log-level", "warning",
               "--drain-timeout", "30", "--served-model-name", "smol"]
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()  # never let a full pipe block the server

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("kiln: serving") and " at " in line:
                self.url = line.split(" at ", 1)[1].split()[0].removesuffix("/v1")
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 120.0) -> str:
        self._ready.wait(timeout)
        if self.url is None:
            raise AssertionError(f"kiln serve did not start: {''.join(self.lines)}")
        return self.url


@pytest.fixture(scope="module")
def server(embedded_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess(embedded_dir, tmp_path_factory.mktemp("serve") / "stderr.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()


def test_serve_prints_a_start_up_summary(server: ServeProcess) -> None:
    text = "".join(server.lines)
    for expected in ("kiln serve", "smol", "-O0", "float32 / cpu", "KV cache", "blocks x 16 tokens",
                     "load / compile seconds"):
        assert expected in text, text
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_serve_logs_one_start_up_line_that_counts_the_load(server: ServeProcess) -> None:
    """`kiln serve` loads the weights before it builds the engine (a progress stage of its own); the engine's
    start-up line still counts that load: `load` is at least the loader's own seconds, and `total` holds it."""
    log = Path(server.log.name).read_text()
    lines = [line.split("kiln ready in ", 1)[1] for line in log.splitlines() if "kiln ready in " in line]
    assert len(lines) == 1, log  # at the default log level, once
    total, phases = lines[0].split(" s: ", 1)
    seconds = {name: float(value) for name, value in (part.split() for part in phases.split(", "))}
    assert list(seconds) == [*PHASES, "other"], lines[0]
    row = next(line for line in server.lines if "load / compile seconds" in line)
    loader_seconds = float(row.split()[-3])  # "load / compile seconds  0.4 / 0.0": the loader's own figure
    assert seconds["load"] >= loader_seconds and seconds["load"] > 0, (lines[0], row)
    assert float(total) >= sum(seconds.values()) - 0.1 * len(seconds)  # one-decimal rounding of each


def test_bench_serve_random_prints_the_table(server: ServeProcess, capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", str(server.url), "--num-prompts", "12", "--random-input-len", "16",
               "--random-output-len", "6", "--ignore-eos", "--max-concurrency", "6", "--save-result", str(result)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for row in ("Serving Benchmark Result", "Successful requests:", "Request throughput (req/s):",
                "Output token throughput (tok/s):", "Mean TTFT (ms):", "P99 TTFT (ms):", "Median TPOT (ms):",
                "P90 ITL (ms):", "P99 E2EL (ms):"):
        assert row in out, out
    saved = json.loads(result.read_text())
    assert saved["completed"] == 12 and saved["failed"] == 0
    assert saved["total_output_tokens"] == 12 * 6  # from the server's usage, ignore_eos makes it exact
    assert saved["ttft_ms"]["p99"] >= saved["ttft_ms"]["median"] > 0


def test_bench_serve_sharegpt_chat_poisson(server: ServeProcess, capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    data = [{"conversations": [{"from": "human", "value": f"Tell me about topic number {i}, briefly please."},
                               {"from": "gpt", "value": "Here is a short answer about it, in a few words."}]}
            for i in range(10)]
    data.append({"conversations": [{"from": "human", "value": "too short"}]})  # skipped: no reply
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    rc = main(["bench", "serve", "--base-url", str(server.url), "--endpoint", "/v1/chat/completions",
               "--dataset-path", str(path), "--num-prompts", "6", "--request-rate", "20", "--sharegpt-output-len",
               "4", "--disable-tqdm"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "request rate: 20" in out
    line = next(x for x in out.splitlines() if x.startswith("Successful requests:"))
    assert line.split()[-1] == "6"


def test_chat_against_the_server(server: ServeProcess) -> None:
    lines = "What is the capital of France?\n/clear\n/exit\nnever read\n"
    done = subprocess.run([sys.executable, "-m", "kiln", "chat", "--url", f"{server.url}/v1", "--temperature",
                           "0", "--max-tokens", "12"], input=lines, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout and "(conversation cleared)" in done.stdout


def test_sigterm_drains_in_flight_requests_and_exits_cleanly(server: ServeProcess) -> None:
    """Last in this module: it stops the server."""
    body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 30, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    first_token = threading.Event()
    events: list[dict[str, Any]] = []

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    first_token.set()

    client = threading.Thread(target=stream)
    client.start()
    assert first_token.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    with pytest.raises(httpx.ConnectError):  # no longer listening, while the stream still runs
        httpx.get(f"{server.url}/health", timeout=5)
    client.join(120)
    assert server.proc.wait(60) == 0
    # finished, not cut off: all 30 tokens generated (counted by the server; a token's text delta can be empty)
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 30
    assert "kiln: server stopped" in "".join(server.lines)


def test_bench_throughput_offline(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "throughput", "tiny-llama", "-O0", "--device", "cpu", "--num-prompts", "8", "--input-len",
               "16", "--output-len", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Offline Throughput Result" in out and "Output token throughput (tok/s):" in out
    assert next(x for x in out.splitlines() if x.startswith("Output tokens:")).split()[-1] == "64"


def test_chat_keeps_history_and_handles_commands(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.entrypoints.cli import chat as cli_chat

    seen: list[list[dict[str, str]]] = []

    def fake_backend(args: Any) -> Any:
        def reply(messages: list[dict[str, str]]) -> Iterator[str]:
            seen.append([dict(m) for m in messages])
            yield "reply "
            yield str(len(seen))
        return "fake", reply

    monkeypatch.setattr(cli_chat, "local_backend", fake_backend)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nhow are you?\n/system be brief\nagain\n/clear\nnew\n"))
    assert main(["chat", "--system", "sys"]) == 0
    out = capsys.readouterr().out
    assert "reply 1" in out and "reply 4" in out and "(conversation cleared)" in out
    assert seen[1] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "reply 1"}, {"role": "user", "content": "how are you?"}]
    assert seen[2][0] == {"role": "system", "content": "be brief"} and len(seen[2]) == 6
    assert seen[3] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "new"}]


def test_chat_local_model(embedded_dir: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\n"))
    assert main(["chat", str(embedded_dir), "-O0", "--device", "cpu", "--temperature", "0", "--max-tokens",
                 "12", "--kv-cache-bytes", str(64 << 20)]) == 0
    assert "Paris" in capsys.readouterr().out


def test_serve_freezes_what_start_up_left_alive(embedded_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """By the time the server runs, the engine's objects are out of the collector's sight (gc.freeze): a full
    collection then walks only what serving allocates, not every module, tensor and compiled artifact."""
    import gc

    from kiln.entrypoints.server import launcher

    frozen: list[int] = []

    class NoServer:
        def run(self) -> None:
            frozen.append(gc.get_freeze_count())

    monkeypatch.setattr(launcher, "make_server", lambda *args, **kwargs: NoServer())
    try:
        assert main(["serve", str(embedded_dir), "-O0", "--device", "cpu", "--port", "0", "--no-progress"]) == 0
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] > 10_000


@pytest.mark.parametrize("args", [["--port", "70000"], ["--port", "-1"], ["--max-queue", "0"], ["--max-queue", "-5"],
                                  ["--drain-timeout", "nan"], ["--drain-timeout", "-1"]])
def test_serve_options_out_of_range_stop_at_parse_time(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Before any model loads (a port past 65535 failed in the bind, after the load; --max-queue 0 started a server
    that answered every request with 503)."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "-O0", "--device", "cpu", *args])
    assert info.value.code == 2 and args[0] in capsys.readouterr().err


def test_cache_clear_with_an_empty_key_deletes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.cache.store import compile_root

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    keys = [compile_root() / name for name in ("aaa111", "bbb222")]
    for key in keys:
        key.mkdir(parents=True)
    assert main(["cache", "clear", ""]) == 2
    assert all(key.is_dir() for key in keys)
    assert main(["cache", "clear", "aaa"]) == 0 and not keys[0].exists() and keys[1].is_dir()


def test_cache_ls_shows_factors_of_the_wrong_shape_as_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.cache.store import FACTORS, compile_root

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    for name, factors in (("aaa111", "[1]"), ("bbb222", '{"model": "x", "compilation": 3}')):
        (compile_root() / name).mkdir(parents=True)
        (compile_root() / name / FACTORS).write_text(factors)
    assert main(["cache", "ls"]) == 0
    listing = capsys.readouterr().out
    assert "aaa111" in listing and "bbb222" in listing and "-O?" in listing


def test_a_sharegpt_file_of_other_records_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "sg.json"
    data.write_text(json.dumps([1, 2, {"conversations": ["hello there friend", "how are you doing today"]}]))
    assert main(["bench", "throughput", "tiny-llama", "-O0", "--device", "cpu", "--dataset-path", str(data)]) == 2
    err = capsys.readouterr().err
    assert "kiln: error:" in err and "no usable conversations" in err and "Traceback" not in err


def test_an_unreadable_config_is_one_line_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{bad")
    assert main(["generate", "--model", str(tmp_path), "-O0", "--device", "cpu", "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert "kiln: error:" in err and "Traceback" not in err


def test_heads_that_do_not_split_over_the_ranks_fail_before_any_worker_starts(
        embedded_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln import Runtime
    from kiln.runtime import tp_processes

    def spawn(*args: Any) -> None:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(tp_processes, "spawn_workers", spawn)
    with pytest.raises(ValueError, match="num_attention_heads 9 is not divisible by tensor parallel size 2"):
        Runtime(str(embedded_dir), level=0, device="cpu", tensor_parallel_size=2)


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", [["chat", "--url", "http://127.0.0.1:{port}/v1"],
                                     ["bench", "serve", "--base-url", "http://127.0.0.1:{port}", "--num-prompts", "2"]])
def test_a_server_that_is_not_there_is_one_line_not_a_traceback(command: list[str], monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    port = _closed_port()
    assert main([word.format(port=port) for word in command]) == 2
    err = capsys.readouterr().err
    assert f"kiln: error: could not list the models at http://127.0.0.1:{port}/v1" in err and "Traceback" not in err
