"""Worker processes that start from kiln's own entry point, never from the user's main script.

multiprocessing's `spawn` (and `forkserver`) start method prepares each child by importing the parent's
`__main__` again: a plain script that builds a `Runtime` at top level, without `if __name__ == "__main__":`,
would build one in every compile worker. So kiln's workers (the compile pool, the kernel warm-up, the
tensor-parallel ranks) run `kiln.compiler.child_process.main` as their main, as Inductor's compile workers run
a main of their own: the child imports kiln, says hello, and then runs the calls its parent sends over a pipe.

The parent's import path goes to the child (PYTHONPATH, as spawn sends `sys.path`), after the directory of the
parent's own kiln, so a function pickled by reference from any module the parent can import is found there; the
user's script is not a module the child imports. Calls travel as length-prefixed pickles on two pipes of their
own (stdin is /dev/null, stdout and stderr are the parent's, so a worker's prints and logs appear as before). A
reply is (True, result) or (False, exception). `start` sends one call with no reply wanted and closes the pipe:
the child runs it and exits when it returns (a tensor-parallel rank's whole life), an exception printing its
traceback as a `multiprocessing.Process` target's would. The child ignores SIGINT: Ctrl-C reaches every process
of the terminal's group, and the parent alone decides what to stop (it terminates its workers).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

# `-c` puts the working directory ('') first on the child's path: dropped, so the child imports what the parent
# would (its path comes as PYTHONPATH), not some other checkout of kiln that happens to be the working directory
ENTRY = ("import sys; sys.path[:] = [p for p in sys.path if p]; "
         "from kiln.compiler.child_process import main; main(sys.argv)")
HELLO = b"kiln"
KILN_ROOT = str(Path(__file__).resolve().parents[2])  # the directory this kiln was imported from
_LENGTH = struct.Struct("<Q")
_WITH_REPLY, _NO_REPLY = b"r", b"n"


def _send(stream: IO[bytes], data: bytes) -> None:
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> bytes | None:
    """One frame, or None at end of file (the other side closed its end or exited)."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(header)
    data = stream.read(length)
    return data if len(data) == length else None


class ChildProcess:
    """One worker process; `call` (a reply) and `start` (none) run a picklable callable in it. Also offers the
    lifecycle of a `multiprocessing.Process` (pid, exitcode, is_alive, join, terminate, kill)."""

    def __init__(self, name: str) -> None:
        self.name = name
        child_in, to_child = os.pipe()
        from_child, child_out = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([KILN_ROOT, *(p or os.getcwd() for p in sys.path)])}
        try:
            self._popen = subprocess.Popen([sys.executable, "-c", ENTRY, str(child_in), str(child_out), name],
                                           stdin=subprocess.DEVNULL, pass_fds=(child_in, child_out), env=env)
        except BaseException:
            os.close(to_child)
            os.close(from_child)
            raise
        finally:
            os.close(child_in)
            os.close(child_out)
        self._to_child: IO[bytes] | None = os.fdopen(to_child, "wb")
        self._from_child = os.fdopen(from_child, "rb")
        self._ready = False

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; negative: the signal that ended it (as multiprocessing reports it)."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def wait_ready(self, timeout: float) -> bool:
        """True once the child has started (imported kiln and said hello); False if it exited first or did not
        say hello within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self._ready:
            readable, _, _ = select.select([self._from_child], [], [], max(0.0, min(0.1, deadline - time.monotonic())))
            if readable:
                self._ready = _receive(self._from_child) == HELLO
                return self._ready
            if time.monotonic() >= deadline:
                return False
        return True

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in the child; its exception is raised here. ChildProcessError if the child is gone."""
        self._send_call(_WITH_REPLY, fn, args)
        if not self._ready:
            self._ready = _receive(self._from_child) == HELLO
        reply = _receive(self._from_child) if self._ready else None
        if reply is None:
            self.join(1.0)
            raise ChildProcessError(f"{self.name} (pid {self.pid}) exited (code {self.exitcode}) during a call")
        try:
            ok, value = pickle.loads(reply)  # noqa: S301 - from our own child process
        except Exception as exc:  # noqa: BLE001 - e.g. an exception class that cannot be rebuilt here
            raise ChildProcessError(f"{self.name}: its reply could not be read ({exc!r})") from exc
        if not ok:
            raise value
        return value

    def start(self, fn: Callable[..., Any], *args: Any) -> None:
        """fn(*args) in the child, which exits once it returns; no more calls."""
        self._send_call(_NO_REPLY, fn, args)
        self.close_input()

    def close_input(self) -> None:
        """No more calls: the child exits once it has finished the current one."""
        stream, self._to_child = self._to_child, None
        if stream is not None:
            try:
                stream.close()
            except OSError:  # the child is gone; the pipe's buffered data with it
                pass

    def close(self) -> None:
        """Release both pipes (after the child has exited or been stopped)."""
        self.close_input()
        self._from_child.close()

    def _send_call(self, mode: bytes, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if self._to_child is None:
            raise ChildProcessError(f"{self.name} takes no more calls")
        data = mode + pickle.dumps((fn, args))
        try:
            _send(self._to_child, data)
        except (BrokenPipeError, ValueError) as exc:
            raise ChildProcessError(f"{self.name} (pid {self.pid}) is gone (code {self.exitcode})") from exc


def _reply_for(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    try:
        result: tuple[bool, Any] = (True, fn(*args))
    except Exception as exc:  # noqa: BLE001 - the parent decides what a failure means
        result = (False, exc)
    try:
        return pickle.dumps(result)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result or exception: its text instead
        value = result[1] if not result[0] else exc
        return pickle.dumps((False, RuntimeError(f"{type(value).__name__}: {value}")))


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    incoming, outgoing = os.fdopen(int(argv[1]), "rb"), os.fdopen(int(argv[2]), "wb")
    _send(outgoing, HELLO)
    while (frame := _receive(incoming)) is not None:
        mode, payload = frame[:1], frame[1:]
        if mode == _NO_REPLY:
            fn, args = pickle.loads(payload)  # noqa: S301 - from our parent process
            fn(*args)
            continue
        try:
            fn, args = pickle.loads(payload)  # noqa: S301
        except Exception as exc:  # noqa: BLE001 - e.g. a module the parent has and this process cannot import
            _send(outgoing, pickle.dumps((False, RuntimeError(f"cannot unpickle the call: {exc!r}"))))
            continue
        _send(outgoing, _reply_for(fn, args))

