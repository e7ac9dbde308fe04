import json, os, time, statistics
import torch
from kiln import Runtime
from benchmarks.common import start_decoding, sync

out = {}
rt = Runtime(os.environ.get("PROBE_MODEL", "smollm2-135m"), device="cuda", dtype="bf16", load_format="dummy",
             attention_backend="triton", cudagraph_capture_sizes=(1,))
eng = rt.engine
replays = []
orig = torch.cuda.CUDAGraph.replay
def timed(self):
    t = time.perf_counter(); orig(self); replays.append(time.perf_counter() - t)
torch.cuda.CUDAGraph.replay = timed
for mode in (True, False):
    eng.async_scheduling = mode
    start_decoding(eng, 1, 128, max_tokens=200)
    for _ in range(4): eng.step()
    sync(); replays.clear()
    steps = []
    t0 = time.perf_counter()
    for _ in range(64):
        t = time.perf_counter(); eng.step(); steps.append(time.perf_counter() - t)
    sync()
    wall = (time.perf_counter() - t0) / 64
    out["async" if mode else "sync"] = {"step_ms": wall * 1e3, "replay_host_us_median": statistics.median(replays) * 1e6,
        "replay_host_us_mean": statistics.mean(replays) * 1e6, "replays_per_step": len(replays) / 64,
        "step_call_ms_median": statistics.median(steps) * 1e3}
    while eng.has_unfinished(): eng.step()
# the bare graph: replay back to back, host time per launch and device time per replay
g = list(eng.runner.full_graph.entries.values())
graph = g[0][0].graph
sync(); t = time.perf_counter()
for _ in range(200): orig(graph)
host = (time.perf_counter() - t) / 200; sync(); total = (time.perf_counter() - t) / 200
out["bare_replay"] = {"host_us": host * 1e6, "wall_us_per_replay": total * 1e6, "graphs": len(g)}
print(json.dumps(out, indent=1))
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "launch_probe.json"), "w"), indent=1)
