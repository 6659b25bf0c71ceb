"""The training job `benchmarks/recovery.py` kills and restarts: the same small DDP job written against
shoal (`--impl shoal`, under `shoal run`) or against torch.distributed (`--impl torch`, under torchrun);
with `--impl live` (under `shoal run --live`), the job is not restarted: the survivors go on, and a
worker the launcher starts in the lost one's place (`--max-restarts`) joins them.

It checkpoints every `--every` steps, resumes from the newest checkpoint, and prints wall-clock
times: `death T` just before rank 1 SIGKILLs itself at `--kill-at` in the first attempt (or, with
`--kill-launcher`, rank 0 its launcher), and
`step N T` after every step, so the driver can measure death-to-first-step; a joiner prints `ready T`
once it has imported and built everything, just before it asks to join.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn


def _first_attempt() -> bool:
    return os.environ.get("SHOAL_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == "0"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["shoal", "torch", "live"], required=True)
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--min-workers", type=int, default=1, help="--impl live: wait for joiners below this")
    parser.add_argument("--shard", action="store_true", help="--impl live: fully_shard the model")
    parser.add_argument("--hidden", type=int, default=256, help="--impl live: the hidden layer's width")
    parser.add_argument("--kill-at", type=int, default=25)
    parser.add_argument("--kill-launcher", action="store_true",
                        help="--impl live: rank 0 SIGKILLs its launcher instead (its node, and the store primary)")
    parser.add_argument("--death-file", type=Path, help="write `death T` here (a killed launcher passes on no output)")
    args = parser.parse_args()
    if args.impl != "live" and args.dir is None:
        parser.error("--dir is needed to checkpoint and resume (all but --impl live)")
    torch.set_num_threads(1)
    if args.impl == "live":
        live(args)
        return
    if args.impl == "shoal":
        import shoal.distributed as dist
        from shoal.checkpoint import CheckpointManager
        from shoal.parallel import DistributedDataParallel as DDP

        dist.init_process_group("shoal")
        rank = dist.get_rank()
        manager = CheckpointManager(args.dir)
        latest = manager.load_latest()
        start, state = (latest.step, latest.state) if latest else (0, None)
        save = lambda step, s: manager.save(step, s)  # noqa: E731
    else:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        files = sorted(args.dir.glob("step-*.pt")) if args.dir.exists() else []
        start = int(files[-1].stem.split("-")[1]) if files else 0
        state = torch.load(files[-1], weights_only=True) if files else None
        args.dir.mkdir(parents=True, exist_ok=True)

        def save(step: int, s: dict) -> None:
            if rank == 0:
                tmp = args.dir / f".step-{step:06d}.tmp"
                torch.save(s, tmp)
                tmp.rename(args.dir / f"step-{step:06d}.pt")

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    if state is not None:
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    model = DDP(net)
    gen = torch.Generator().manual_seed(rank)
    for step in range(start + 1, args.steps + 1):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        print(f"step {step} {time.time():.6f}", flush=True)
        if step % args.every == 0:
            save(step, {"model": net.state_dict(), "optim": optimizer.state_dict()})
        if step == args.kill_at and rank == 1 and _first_attempt():
            print(f"death {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()
    sys.exit(0)


def live(args: argparse.Namespace) -> None:
    """The same model and batches of 32 per worker, with live recovery (of DDP, or of fully_shard with each
    block also held by a buddy): `step N T` after each committed step."""
    from shoal.data import ElasticSampler
    from shoal.elastic import LiveTraining

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gen = torch.Generator().manual_seed(0)
    samples = 32 * world * args.steps
    data = torch.utils.data.TensorDataset(torch.randn(samples, 64, generator=gen),
                                          torch.randint(0, 10, (samples,), generator=gen))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    if args.shard:
        from shoal.parallel import fully_shard

        for layer in (net[0], net[2], net):
            fully_shard(layer)
    sampler = ElasticSampler(data, 32, rank=rank, world_size=world)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    if not _first_attempt():
        print(f"ready {time.time():.6f}", flush=True)
    job = LiveTraining(net, optimizer, sampler, min_workers=args.min_workers)
    victim = 0 if args.kill_launcher else 1
    for x, y in job.batches(torch.utils.data.DataLoader(data, batch_sampler=sampler)):
        if job.steps == args.kill_at and rank == victim and _first_attempt():
            if args.death_file:
                args.death_file.write_text(f"death {time.time():.6f}")
            else:
                print(f"death {time.time():.6f}", flush=True)
            os.kill(os.getppid() if args.kill_launcher else os.getpid(), signal.SIGKILL)
            time.sleep(60)  # the kernel kills this worker with its launcher (shoal.orphans)
        committed = job.steps
        with job.step():
            nn.functional.cross_entropy(job.model(x), y).backward()
        if job.steps > committed:
            print(f"step {job.steps} {time.time():.6f}", flush=True)
    job.close()


if __name__ == "__main__":
    main()
