"""`kiln <command>`: serve, generate, chat, warmup, cache, bench (`main.py` dispatches)."""
