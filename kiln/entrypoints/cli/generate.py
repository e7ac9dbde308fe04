"""`kiln generate "prompt"`: one-shot generation (chat template applied when the model has one)."""

from __future__ import annotations

import argparse
import sys

from kiln.entrypoints.cli.main import add_runtime_args, runtime_kwargs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for a prompt")
    p.add_argument("prompt", help="the prompt text")
    add_runtime_args(p, model_positional=False)
    p.add_argument("--model", default=None, help="HF directory or preset (default: embedded SmolLM2)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln import Runtime, SamplingParams

    # shut down on the way out: background compiles still running are cancelled, not waited for
    with Runtime(args.model, **runtime_kwargs(args)) as runtime:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed if args.temperature > 0 else None)
        tokenizer = runtime.tokenizer
        use_chat = not args.raw and tokenizer is not None and getattr(tokenizer, "chat_template", None)
        prompt = runtime.apply_chat_template([{"role": "user", "content": args.prompt}]) if use_chat else args.prompt
        if args.stream:
            for out in runtime.stream(prompt, params):
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            print(runtime.generate([prompt], params)[0].outputs[0].text)
    return 0
