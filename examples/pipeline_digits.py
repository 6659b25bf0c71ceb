"""Pipeline parallelism on the digits: an MLP (64-128-128-10) cut into one stage per rank and trained with
1F1B micro-batches. The last stage also trains the unsplit model on the same batches and compares: the
pipeline's gradients are the whole batch's, so both reach the same test accuracy.

    shoal run --nproc-per-node 2 examples/pipeline_digits.py
    shoal run --nproc-per-node 2 examples/pipeline_digits.py --schedule gpipe --microbatches 8 --backend gloo
    shoal run --nproc-per-node 3 examples/pipeline_digits.py          # three stages
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import shoal.distributed as dist
from shoal.demo import digits
from shoal.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe, split_sequential

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return (logits.argmax(dim=1) == labels).double().mean().item()


def run(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial model on every rank; each keeps its own stage
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 10))
    reference = copy.deepcopy(model)  # the unsplit model, trained on the last rank for comparison
    part = split_sequential(model, world)[rank]
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    train = SCHEDULES[args.schedule](stage, args.microbatches, loss_fn=nn.functional.cross_entropy)
    evaluate = ScheduleGPipe(stage, args.microbatches)  # no loss_fn: forward only
    optimizer = torch.optim.SGD(part.parameters(), lr=args.lr, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=args.lr, momentum=0.9)
    (images, labels), (test_images, test_labels) = (data.tensors for data in digits())
    for epoch in range(args.epochs):
        # Every rank draws the same order: stage 0 needs the images, the last stage their labels.
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(args.seed + epoch))
        epoch_loss = 0.0
        for start in range(0, len(order), args.batch_size):
            x, y = images[order[start:start + args.batch_size]], labels[order[start:start + args.batch_size]]
            optimizer.zero_grad()
            if stage.is_first and not stage.is_last:
                train.step(x)
            elif stage.is_last:
                losses: list[torch.Tensor] = []
                train.step(*((x,) if stage.is_first else ()), target=y, losses=losses)
                rows = [len(chunk) for chunk in torch.tensor_split(y, args.microbatches)]
                epoch_loss += sum(loss.item() * n for loss, n in zip(losses, rows, strict=True))
                reference_optimizer.zero_grad()
                # What a schedule's gradients are the gradient of: the mean of the micro-batches' mean losses
                # (the batch's mean loss, except for a last batch that the micro-batches do not divide).
                chunks = zip(torch.tensor_split(x, args.microbatches), torch.tensor_split(y, args.microbatches),
                             strict=True)
                torch.stack([nn.functional.cross_entropy(reference(cx), cy) for cx, cy in chunks]).mean().backward()
                reference_optimizer.step()
            else:
                train.step()
            optimizer.step()
        with torch.no_grad():
            logits = evaluate.step(*((test_images,) if stage.is_first else ()))
            if stage.is_last:
                ours, theirs = accuracy(logits, test_labels), accuracy(reference(test_images), test_labels)
                print(f"epoch {epoch}: loss {epoch_loss / len(order):.4f}, test accuracy pipeline {ours:.2%}, "
                      f"unsplit model {theirs:.2%}", flush=True)
    if stage.is_last:
        mine = dict(reference.named_parameters())  # stages keep the unsplit model's parameter names
        gap = max((p - mine[n]).abs().max().item() for n, p in part.named_parameters())
        print(f"final test accuracy: pipeline {ours:.2%}, unsplit model {theirs:.2%}", flush=True)
        print(f"largest parameter difference from the unsplit model (stage {stage.stage_index}): {gap:.2e}",
              flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="shoal", choices=["shoal", "gloo"])
    parser.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    run(args)
    dist.destroy_process_group()
