"""The top of the house: what users run. The command line (`cli/`), the OpenAI-compatible HTTP server
(`server/`) and the benchmark clients (`bench/`) import the runtime; nothing below imports them
(tests/test_layout.py enforces it). See docs/architecture.md."""
