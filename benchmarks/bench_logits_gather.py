"""The vocab-parallel logits gather under tensor parallelism: host and device time per call of the
functional-collective path (all_gather_tensor + chunk + cat) vs kiln's eager path (c10d
all_gather_into_tensor + one transposing copy), with a check that both give the same tensor.

It runs eagerly on rank 0's host every step, and rank 0's host bounds a TP step (docs/distributed.md), so
host microseconds per call are the number that matters; device time shows the copy is no slower.

    python -m benchmarks.bench_logits_gather [--world 2] [--device cuda] [--rows 1 64 256] [--out FILE.json]

On GPUs set NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

VOCAB_PER_RANK = 128256 // 2  # Llama-3's vocabulary over 2 ranks


def functional_gather(x: torch.Tensor, group, size: int) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    gathered = funcol.all_gather_tensor(x.contiguous(), 0, group)
    return torch.cat(gathered.chunk(size, dim=0), dim=-1)


def kiln_gather(x: torch.Tensor) -> torch.Tensor:
    from kiln.models.parallel import all_gather_last_dim

    return all_gather_last_dim(x)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, device: torch.device, repeats: int) -> tuple[float, float]:
    """(median host us per call, device-inclusive us per call over a synchronized batch of calls)."""
    for _ in range(5):
        fn()
    sync(device)
    host = []
    start = time.perf_counter()
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t)
    sync(device)
    total = (time.perf_counter() - start) / repeats
    return statistics.median(host) * 1e6, total * 1e6


def rank_main(rank: int, world: int, port: int, device_kind: str, rows_list: list[int], repeats: int,
              out: str | None) -> None:
    from kiln.models.parallel import TPGroup, set_tp_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    set_tp_group(TPGroup(rank, world, group))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    per_rank = VOCAB_PER_RANK if device.type == "cuda" else 4096
    results = {}
    for rows in rows_list:
        try:
            x = torch.randn(rows, per_rank, dtype=dtype, device=device, generator=None) + rank
            with torch.inference_mode():
                same = torch.equal(functional_gather(x, group, world), kiln_gather(x))
                f_host, f_total = time_calls(lambda x=x: functional_gather(x, group, world), device, repeats)
                k_host, k_total = time_calls(lambda x=x: kiln_gather(x), device, repeats)
            results[rows] = {"equal": same, "funcol_host_us": f_host, "funcol_total_us": f_total,
                             "kiln_host_us": k_host, "kiln_total_us": k_total}
        except Exception:
            results[rows] = {"error": traceback.format_exc()}
    set_tp_group(TPGroup())
    dist.barrier()  # no rank tears down while a peer still gathers
    dist.destroy_process_group()
    if rank != 0:
        return
    print(f"logits gather, {world} ranks on {device_kind}, [rows, {per_rank}] {dtype} per rank, median of {repeats}")
    print(f"{'rows':>5} {'equal':>6} {'funcol host us':>15} {'kiln host us':>13} {'host ratio':>10} "
          f"{'funcol total us':>16} {'kiln total us':>14}")
    for rows, r in results.items():
        if "error" in r:
            print(f"{rows:>5} error: {r['error'].splitlines()[-1]}")
            continue
        print(f"{rows:>5} {str(r['equal']):>6} {r['funcol_host_us']:>15.1f} {r['kiln_host_us']:>13.1f} "
              f"{r['funcol_host_us'] / r['kiln_host_us']:>9.1f}x {r['funcol_total_us']:>16.1f} "
              f"{r['kiln_total_us']:>14.1f}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"world": world, "device": device_kind, "per_rank": per_rank, "results": results}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.spawn(rank_main, args=(args.world, port, args.device, args.rows, args.repeats, args.out), nprocs=args.world)


if __name__ == "__main__":
    main()
