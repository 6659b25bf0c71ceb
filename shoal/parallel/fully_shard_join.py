"""fully_shard under Join: a rank that has run out of inputs takes its part in the live ranks' steps.

Each rank holds only its rows of every parameter, so a joined rank cannot simply stop: the live ranks'
gathers need its rows, their reduce-scatters its contribution, and its rows need stepping with the mean
gradient like everyone's. Every live forward of the root, after Join's notification, all-reduces whether
this step trains (`announce_step`); the joined rank's `main_hook` meets it with a 0 and then makes the
collectives a step of its own made last, in the same order (the tree records them as they start): a gather
with its rows, a reduce-scatter of zeros whose result is its rows' mean gradient; then, for a training
step, it steps its optimizer, as the live ranks step theirs.

    with Join([model], optimizer=opt):      # model: the root fully_shard module
        for x, y in my_batches:             # one forward and one backward per iteration
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shoal.parallel.join import Join, JoinHook

if TYPE_CHECKING:
    from shoal.parallel.fully_shard import FSDPModule


def announce_step(module: FSDPModule) -> None:
    """Under Join, tell the joined ranks that this rank is live, and whether its step trains."""
    if not module._join_config.enable:
        return
    Join.notify_join_context(module)
    trains = torch.tensor([1.0 if torch.is_grad_enabled() else 0.0], device=module.join_device)
    module.join_process_group.all_reduce(trains).wait()


class FullyShardJoinHook(JoinHook):
    """Shadows the live ranks' steps with this rank's rows, and steps them with `optimizer`."""

    def __init__(self, module: FSDPModule, optimizer: torch.optim.Optimizer | None) -> None:
        tree = module._shoal_shards.tree
        if tree is not None and tree.root is not module._shoal_shards:
            raise ValueError(f"Join takes the root fully_shard module (the model), not the {type(module).__name__} "
                             f"inside it")
        if optimizer is None:
            raise ValueError("Join over a fully_shard model needs its optimizer: Join([model], optimizer=opt). A "
                             "rank that has run out of inputs still holds rows of every parameter, and steps them "
                             "with the live ranks' mean gradient")
        self.module = module
        self.optimizer = optimizer

    def main_hook(self) -> None:
        trains = torch.zeros(1, device=self.module.join_device)
        self.module.join_process_group.all_reduce(trains).wait()
        training = trains.item() > 0
        tree = self.module._shoal_shards.tree
        ops = None if tree is None else tree.training_ops if training else tree.forward_ops
        if ops is None:
            raise RuntimeError("a rank that ran no step of its own under fully_shard cannot take part in the "
                               "others' steps under Join: it learns their collectives from its own; give every "
                               "rank at least one batch")
        if training:
            self.optimizer.zero_grad()
        _shadow(ops)
        if training:
            self.optimizer.step()


def _shadow(ops: list[tuple[Any, tuple]]) -> None:
    """Make again, in order, the collectives a step of this rank's made (by member: a `_Sharding`)."""
    for member, op in ops:
        if op[0] == "gather":
            member.group.shadow_gather()
        else:
            member.group.shadow_reduce(op[1])
