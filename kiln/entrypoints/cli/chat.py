"""`kiln chat [MODEL]`: an interactive terminal chat that keeps the conversation.

Runs the model in-process through Runtime by default, or talks to any OpenAI-compatible server with
`--url`. Reads one user message per line from stdin (so it also works piped), streams the reply.
Commands: /exit, /clear (forget the conversation), /system TEXT (set the system prompt).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from kiln.entrypoints.cli.main import add_runtime_args, runtime_kwargs

Messages = list[dict[str, str]]
HELP = "commands: /exit, /clear (forget the conversation), /system TEXT (set the system prompt)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive chat with a model in the terminal")
    add_runtime_args(p)
    p.add_argument("--url", default=None,
                   help="chat with a running OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1) "
                        "instead of loading the model here")
    p.add_argument("--api-key", default=os.environ.get("KILN_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--model-name", default=None, help="with --url: the model to ask for (default: the first)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.set_defaults(func=run)


def local_backend(args: argparse.Namespace) -> tuple[str, Callable[[Messages], Iterator[str]]]:
    from kiln import Runtime, SamplingParams

    runtime = Runtime(args.model, **runtime_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed if args.temperature > 0 else None)

    def reply(messages: Messages) -> Iterator[str]:
        for out in runtime.stream(runtime.apply_chat_template(messages), params):
            yield out.outputs[0].delta_text

    from kiln.entrypoints.server.app import default_model_name

    return default_model_name(args.model), reply


def remote_backend(args: argparse.Namespace) -> tuple[str, Callable[[Messages], Iterator[str]]]:
    import openai

    client = openai.OpenAI(base_url=args.url, api_key=args.api_key or "EMPTY")
    try:
        model = args.model_name or client.models.list().data[0].id
    except openai.APIError as exc:  # the CLI prints an OSError as one line
        raise OSError(f"could not list the models at {args.url}: {exc}") from exc

    def reply(messages: Messages) -> Iterator[str]:
        try:
            stream = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                    max_tokens=args.max_tokens, temperature=args.temperature,
                                                    top_p=args.top_p, stream=True)
        except openai.APIError as exc:
            raise OSError(f"the server at {args.url} answered with an error: {exc}") from exc
        try:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    yield chunk.choices[0].delta.content
        finally:
            stream.close()  # on Ctrl-C the server sees the disconnect and stops generating

    return model, reply


def _read_line(interactive: bool) -> str | None:
    if interactive:
        try:
            return input("> ")
        except EOFError:
            return None
    line = sys.stdin.readline()
    return None if line == "" else line


def run(args: argparse.Namespace) -> int:
    name, reply = remote_backend(args) if args.url else local_backend(args)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    system: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    history: Messages = list(system)
    print(f"kiln chat: {name} ({HELP})", flush=True)
    while True:
        try:
            line = _read_line(interactive)
        except KeyboardInterrupt:
            print()
            break
        if line is None:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/clear":
            history = list(system)
            print("(conversation cleared)", flush=True)
            continue
        if text.startswith("/system"):
            system = [{"role": "system", "content": text[len("/system"):].strip()}]
            history = system + [m for m in history if m["role"] != "system"]
            print("(system prompt set)", flush=True)
            continue
        history.append({"role": "user", "content": text})
        history.append({"role": "assistant", "content": _print_reply(reply(history))})
    return 0


def _print_reply(chunks: Iterator[Any]) -> str:
    """Stream the reply to stdout; Ctrl-C stops it early and keeps what was said so far."""
    parts: list[str] = []
    try:
        for chunk in chunks:
            parts.append(chunk)
            sys.stdout.write(chunk)
            sys.stdout.flush()
    except KeyboardInterrupt:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
        sys.stdout.write(" [interrupted]")
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(parts)
