"""RPC benchmark: shoal.rpc beside torch.distributed.rpc (TensorPipe), two workers, in the same processes.

    python benchmarks/rpc.py            # or: shoal bench rpc [--rounds 5]

Worker 0 calls an echo function on worker 1 and measures, for each library:
- the round-trip latency of rpc_sync with no tensor (`echo(None)`),
- the round-trip latency of rpc_sync with a 1 MiB float32 tensor echoed back,
- calls per second with 64 calls in flight (64 rpc_async issued at once, then all waited for).
The libraries take turns, `--rounds` times, and the table shows the median over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `tests` importable
from shoal.ports import free_port
from tests.ranks import run_ranks

TENSOR_NUMEL = (1 << 20) // 4  # 1 MiB of float32
IN_FLIGHT = 64


def echo(value):
    return value


def _latency(call, arg, seconds: float) -> float:
    """Median seconds per call over batches of back-to-back calls filling about `seconds`."""
    for _ in range(20):
        call(arg)
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < 0.1:
        call(arg)
        count += 1
    per_batch = max(1, int(count * seconds / 10 / 0.1))
    samples = []
    for _ in range(10):
        start = time.perf_counter()
        for _ in range(per_batch):
            call(arg)
        samples.append((time.perf_counter() - start) / per_batch)
    return statistics.median(samples)


def _throughput(call_async, seconds: float) -> float:
    """Calls per second with IN_FLIGHT calls outstanding at a time."""
    for _ in range(3):
        [f.wait() for f in [call_async(None) for _ in range(IN_FLIGHT)]]
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        [f.wait() for f in [call_async(None) for _ in range(IN_FLIGHT)]]
        calls += IN_FLIGHT
    return calls / (time.perf_counter() - start)


def _measure(lib, seconds: float) -> dict[str, float]:
    import torch

    tensor = torch.randn(TENSOR_NUMEL)
    sync = lambda arg: lib.rpc_sync("w1", echo, args=(arg,))  # noqa: E731
    return {"latency": _latency(sync, None, seconds), "tensor": _latency(sync, tensor, seconds),
            "throughput": _throughput(lambda arg: lib.rpc_async("w1", echo, args=(arg,)), seconds)}


def _worker(rank: int, world_size: int, port: int, torch_port: int, rounds: int, seconds: float) -> dict | None:
    import torch
    import torch.distributed.rpc as trpc

    from shoal import rpc

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)  # torch.distributed.rpc's deprecation notices
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2,
                 rpc_backend_options=rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}"))
    trpc.init_rpc(f"w{rank}", rank=rank, world_size=2,
                  rpc_backend_options=trpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{torch_port}"))
    result = None
    if rank == 0:
        samples: dict[str, list[dict[str, float]]] = {"shoal": [], "torch": []}
        for _ in range(rounds):
            samples["shoal"].append(_measure(rpc, seconds))
            samples["torch"].append(_measure(trpc, seconds))
        result = {lib: {key: statistics.median(s[key] for s in rows) for key in rows[0]}
                  for lib, rows in samples.items()}
    trpc.shutdown()
    rpc.shutdown()
    return result  # rank 0's: the caller


def table(result: dict[str, dict[str, float]]) -> list[str]:
    ours, theirs = result["shoal"], result["torch"]
    return [
        "| measure | shoal.rpc | torch.distributed.rpc (TensorPipe) | ratio shoal/torch |",
        "|---|---|---|---|",
        f"| rpc_sync round trip, no tensor | {ours['latency'] * 1e6:,.0f} us | {theirs['latency'] * 1e6:,.0f} us | "
        f"{ours['latency'] / theirs['latency']:.2f}x time |",
        f"| rpc_sync round trip, 1 MiB tensor echoed | {ours['tensor'] * 1e6:,.0f} us | "
        f"{theirs['tensor'] * 1e6:,.0f} us | {ours['tensor'] / theirs['tensor']:.2f}x time |",
        f"| calls/s, {IN_FLIGHT} in flight | {ours['throughput']:,.0f} | {theirs['throughput']:,.0f} | "
        f"{ours['throughput'] / theirs['throughput']:.2f}x rate |",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="turns each library takes (median reported)")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of each measurement")
    args = parser.parse_args(argv)
    result = run_ranks(_worker, 2, free_port(), args.rounds, args.seconds, backend=None, timeout=None)[0]
    print("\n".join(table(result)))


if __name__ == "__main__":
    main(sys.argv[1:])
