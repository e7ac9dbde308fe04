"""The tokenizer, loaded on a background thread while the model loads and compiles.

`AutoTokenizer.from_pretrained` is the process's first `import transformers` (seconds on a busy host) plus
the tokenizer files' parse; neither needs the model, only the directory, so the engine starts it first and
joins it where it needs the tokenizer. The start-up clock's "tokenizer" phase is then the wait at the join.
A later start of the same directory unpickles the tokenizer instead (tokenizer_cache.py).
The thread's exception is kept and raised by `result()` in the constructor's thread: the same exception
object, so its type and message are what a synchronous load raised.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from kiln.runtime.tokenizer_cache import cached_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(tokenizer: str | None, model_dir: Path | None) -> Any:
    """The `tokenizer` option's tokenizer, else the model directory's; None for a preset or weights-only dir."""
    source = tokenizer or model_dir
    if source is None:
        return None
    if tokenizer is None and not any((Path(source) / n).is_file() for n in TOKENIZER_FILES):
        return None  # a weights-only directory: token-id prompts only

    def auto_tokenizer() -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(source))

    return cached_tokenizer(Path(source), auto_tokenizer)


class BackgroundTokenizer:
    """`load_tokenizer(tokenizer, model_dir)` on a thread; `result()` joins it and returns or raises."""

    def __init__(self, tokenizer: str | None, model_dir: Path | None) -> None:
        self.tokenizer, self.model_dir = tokenizer, model_dir
        self._value: Any = None
        self._error: BaseException | None = None
        # not a daemon: a constructor that fails before the join leaves it to finish, not to die mid-import
        self._thread = threading.Thread(target=self._run, name="kiln-tokenizer-load")
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = load_tokenizer(self.tokenizer, self.model_dir)
        except BaseException as exc:  # handed to the joining thread, which raises it
            self._error = exc

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._value
