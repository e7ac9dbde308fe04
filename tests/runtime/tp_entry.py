"""Entry point run on every rank by test_tensor_parallel (as `torchrun` would start it)."""

from __future__ import annotations

import json
import sys

from kiln import Runtime, SamplingParams

if __name__ == "__main__":
    prompts = json.loads(sys.argv[1])
    runtime = Runtime("tiny-qwen3", level=0, device="cpu", tensor_parallel_size=2)  # ranks > 0 never return
    outs = runtime.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    print(json.dumps([o.outputs[0].token_ids for o in outs]))
    runtime.engine.shutdown()
