"""Grammar compilation against the model's vocabulary: on a thread pool, cached (LRU by kind and spec).

Compiling builds xgrammar's per-state token-mask cache over the whole vocabulary: tens of milliseconds for a
schema, too long for the step loop. A request gets a Future at once and waits (outside the batch) until it
resolves; a schema seen before is the same Future. The tokenizer's vocabulary feeds xgrammar's TokenizerInfo
once per model, itself on the pool, so neither start-up nor the first request's caller pays for it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kiln.runtime.structured.params import StructuredOutputsParams


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int], *,
                 max_threads: int = 2, capacity: int = 512) -> None:
        """`vocab_size`: the logits' width. Ids the tokenizer lacks (a padded embedding) are never allowed."""
        self.vocab_size = max(vocab_size, len(tokenizer))
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="kiln-grammar")
        self._capacity = capacity
        self._entries: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._xgr_compiler = self._pool.submit(self._build, tokenizer, sorted(stop_token_ids))
        self.hits = self.misses = 0

    def _build(self, tokenizer: Any, stop_token_ids: list[int]) -> Any:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=stop_token_ids or None)
        # xgrammar's own cache off: this LRU is the one cache, keyed by what the user sent
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar's Future; the same one for a spec compiled (or compiling) before."""
        key = (params.kind, params.spec)
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return future
            self.misses += 1
            future = self._pool.submit(self._compile, params.parsed)
            self._entries[key] = future
            if len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
            return future

    def _compile(self, grammar: Any) -> Any:
        # the compiler's Future resolved first: jobs run in submission order, and it was submitted first
        return self._xgr_compiler.result().compile_grammar(grammar)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
