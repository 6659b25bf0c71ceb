"""fully_shard: ZeRO stage 3 over shoal's collectives, in the call shape of torch's FSDP2.

    for block in model.blocks:
        fully_shard(block)          # each block: one all-gather before its use, one reduce-scatter after
    fully_shard(model)              # what is left (embedding, head); the root
    opt = torch.optim.AdamW(model.parameters())    # each rank's shards: 1/N of the state
    loss_fn(model(x), y).backward(); opt.step()

Every rank holds 1/N of each parameter (its rows), of its gradient and of its optimizer state. A module's
whole parameters exist from just before its forward until just after (`reshard_after_forward`), and again in
backward from just before its gradients are computed until they are reduce-scattered. The next module's
gather starts while this one computes: in forward in the order the last forward ran, in backward in reverse.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from shoal import config
from shoal.comm.api.world import default_group, is_initialized
from shoal.comm.backends.group import ProcessGroup
from shoal.parallel.fully_shard_join import FullyShardJoinHook, announce_step
from shoal.parallel.join import JoinHook, _JoinConfig
from shoal.parallel.shard_group import ShardGroup

__all__ = ["FSDPModule", "fully_shard"]


class FSDPModule:
    """Mixed into the class of each module `fully_shard` was called on, as FSDP2 does: `isinstance(m,
    FSDPModule)` finds them, and these methods act on their parameters."""

    _shoal_shards: _Sharding

    def unshard(self) -> None:
        """Gather the whole parameters now (a collective), e.g. before calling a method other than forward."""
        self._shoal_shards.group.finish_gather()

    def reshard(self) -> None:
        """Free the whole parameters; the module shows its shards again."""
        self._shoal_shards.group.reshard()

    def set_reshard_after_forward(self, reshard_after_forward: bool) -> None:
        """Keep the whole parameters from forward to backward (False: less communication, more memory)."""
        self._shoal_shards.reshard_after_forward = reshard_after_forward

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """For Join([model], optimizer=opt): the root module takes a joined rank's part in the live ranks'
        steps, and steps its rows with `optimizer` (fully_shard_join.py)."""
        return FullyShardJoinHook(self, kwargs.get("optimizer"))

    @property
    def join_device(self) -> torch.device:
        return self._shoal_shards.group.device

    @property
    def join_process_group(self) -> ProcessGroup:
        return self._shoal_shards.group.group


class _Tree:
    """The fully_shard modules under one root: the order of their forwards, and one end of each backward."""

    def __init__(self, root: _Sharding, members: list[_Sharding]) -> None:
        self.root = root
        self.members = members
        self.order: list[_Sharding] = []  # this forward's, so far
        self.last_order: list[_Sharding] = []  # the last whole forward's: what to prefetch
        self.running = False  # the root's forward is under way
        self.in_backward = False
        # The collectives of this step so far, by member, as they start; those of the last forward, and of the
        # last whole training step: what a rank joined under Join makes again (fully_shard_join.py).
        self.step_ops: list[tuple[_Sharding, tuple]] = []
        self.forward_ops: list[tuple[_Sharding, tuple]] | None = None
        self.training_ops: list[tuple[_Sharding, tuple]] | None = None

    def next_in_forward(self, sharding: _Sharding) -> _Sharding | None:
        return _after(self.last_order, sharding)

    def next_in_backward(self, sharding: _Sharding) -> _Sharding | None:
        """Backward runs the forward's order in reverse, but starts with the root, whose forward came first."""
        if sharding is self.root:
            return self.order[-1] if len(self.order) > 1 else None
        return _after(self.order[::-1], sharding)

    def start_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """The end of backward: reduce what no hook reduced (parameters that got no gradient on the way), wait
        for every reduce-scatter, and free every whole parameter. Every rank takes the same steps in the same
        order. A gather started for a module that did not run is dropped: the step will change the shards."""
        for member in self.members:
            member.group.start_reduce()
        self._end_backward(keep_gradients=True)
        self.training_ops = list(self.step_ops)

    def abandon_backward(self) -> None:
        """Forget a backward that raised: its reductions, once done, add nothing (its gradients would be
        partial), and the next backward starts afresh."""
        self._end_backward(keep_gradients=False)

    def _end_backward(self, keep_gradients: bool) -> None:
        for member in self.members:
            if keep_gradients:
                member.group.finish_reduce()
            else:
                member.group.drop_reduce()
            member.group.drop_gather()
            member.group.reshard()
            member.group.end_backward()
            member.backward_started = False
        self.in_backward = False


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def _after(order: list[_Sharding], sharding: _Sharding) -> _Sharding | None:
    for i, member in enumerate(order[:-1]):
        if member is sharding:
            return order[i + 1]
    return None


class _Sharding:
    """One fully_shard call's state: its parameters' group and its hooks."""

    def __init__(self, module: nn.Module, group: ShardGroup, reshard_after_forward: bool) -> None:
        self.module = module
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.tree: _Tree | None = None
        self.backward_started = False
        group.started = self._started
        group.gradients_ready = self._gradients_ready
        module.register_forward_pre_hook(self._before_forward, prepend=True)
        module.register_forward_hook(self._after_forward)
        # torch marks the hook itself, which a bound method refuses
        module.register_state_dict_post_hook(functools.partial(_Sharding._full_state_dict, self))
        module.register_load_state_dict_pre_hook(self._load_rows)

    def _root_of_tree(self) -> _Tree:
        """The first module whose forward runs is the root: its tree is every fully_shard module inside it."""
        members = [m._shoal_shards for m in self.module.modules() if isinstance(m, FSDPModule)]
        tree = _Tree(self, members)
        for member in members:
            member.tree = tree
        return tree

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        tree = self.tree or self._root_of_tree()
        if _in_backward() and tree.in_backward:  # activation checkpointing runs the forward again
            self.group.finish_gather()
            return
        if module._join_config.enable and tree.root is not self:
            raise ValueError(f"Join takes the root fully_shard module (the model), not the {type(module).__name__} "
                             f"inside it")
        if tree.root is self:
            if tree.in_backward:  # the last backward raised before its end, which never came
                tree.abandon_backward()
            tree.order, tree.running, tree.step_ops = [], True, []
            announce_step(module)
        if tree.running:  # not when a block is called on its own
            tree.order.append(self)
        self.group.finish_gather()
        following = tree.next_in_forward(self)
        if following is not None:
            following.group.start_gather()

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        assert self.tree is not None
        if _in_backward() and self.tree.in_backward:  # recomputed: freed once their gradients are reduced
            return output
        training = torch.is_grad_enabled()
        if not training or (self.reshard_after_forward and self.tree.root is not self):
            self.group.reshard()
        if self.tree.root is self:
            self.tree.last_order, self.tree.running = self.tree.order, False
            self.tree.forward_ops = list(self.tree.step_ops)
            if not training:  # no backward will drop a prefetch for a module that did not run
                for member in self.tree.members:
                    member.group.drop_gather()
        if training:
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._before_backward)
        return output

    def _started(self, op: tuple) -> None:
        if self.tree is not None:
            self.tree.step_ops.append((self, op))

    def _before_backward(self, grad: torch.Tensor) -> None:
        """The gradient of one of the module's outputs has arrived: its own backward is next."""
        if self.backward_started:
            return
        assert self.tree is not None
        self.backward_started = True
        self.tree.start_backward()
        self.group.finish_gather()
        following = self.tree.next_in_backward(self)
        if following is not None:
            following.group.start_gather()

    def _gradients_ready(self) -> None:
        assert self.tree is not None
        self.tree.start_backward()
        self.group.start_reduce()
        self.group.reshard()

    def _full_state_dict(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                         local_metadata: Any) -> None:
        """The state dict holds whole parameters (gathered now: every rank calls `state_dict()` together), so
        it loads onto any number of ranks, or into the unsharded module."""
        for slot, full in zip(self.group.params, self.group.full_tensors(), strict=True):
            state_dict[prefix + slot.path] = full

    def _load_rows(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any,
                   strict: bool, missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """A whole parameter in the state dict loads this rank's rows of it into the shard."""
        self.group.drop_gather()
        self.group.reshard()
        for slot in self.group.params:
            value = state_dict.get(prefix + slot.path)
            if isinstance(value, torch.Tensor) and value.shape == slot.full.shape:
                state_dict[prefix + slot.path] = value[slot.block(self.group.rank)]


def _parameters(module: nn.Module, ignored: set[int]) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """The parameters this call shards: the module's and its submodules', less those of submodules already
    sharded by a call of their own and those ignored. Each as (path, owning module, name, parameter)."""
    found: list[tuple[str, nn.Module, str, nn.Parameter]] = []
    seen: dict[int, str] = {}

    def walk(owner: nn.Module, prefix: str) -> None:
        for name, param in owner._parameters.items():
            if param is None:
                continue
            if getattr(param, "_shoal_sharded", False) or (id(param) in seen and id(param) not in ignored):
                first = seen.get(id(param), "a parameter another fully_shard call sharded")
                raise ValueError(f"fully_shard: {prefix + name!r} is the same parameter as {first!r}: shared (tied) "
                                 f"parameters are not sharded; pass it in ignored_params of every fully_shard call "
                                 f"whose module holds it (it then stays whole on every rank, and averaging its "
                                 f"gradient is yours to do)")
            if getattr(param, "_shoal_left_whole", False) and id(param) not in ignored:
                raise ValueError(f"fully_shard: {prefix + name!r} was left whole by an earlier call (its "
                                 f"ignored_params): pass it in this call's ignored_params too")
            if id(param) in ignored:
                param._shoal_left_whole = True
                continue
            seen[id(param)] = prefix + name
            found.append((prefix + name, owner, name, param))
        for child_name, child in owner._modules.items():
            if child is not None and not isinstance(child, FSDPModule):
                walk(child, f"{prefix}{child_name}.")
    walk(module, "")
    return found


_classes: dict[type, type] = {}


def _group_to_shard_over(group: ProcessGroup | None) -> ProcessGroup | None:
    """The group given, else the default one; under `shoal run --live` with none initialized, None: the
    model is sharded over each generation's group by LiveTraining (shoal/elastic/shard_keeper.py)."""
    if group is None and not is_initialized() and config.SHOAL_LIVE.get():
        return None
    return group if group is not None else default_group()


def fully_shard(module: nn.Module, *, mesh: Any = None, group: ProcessGroup | None = None,
                reshard_after_forward: bool = True, ignored_params: Iterable[nn.Parameter] | None = None
                ) -> nn.Module:
    """Shard `module`'s parameters (those not sharded by an earlier call on a submodule) over `group` (the
    default group), in place; returns the module, now also an `FSDPModule`. Call it on the blocks first, then
    on the whole model, and build the optimizer after: `model.parameters()` are then the shards. Under
    `shoal run --live` with no group initialized, LiveTraining shards the model over each generation."""
    if mesh is not None:
        raise TypeError("shoal.parallel.fully_shard shards over a shoal process group: pass group=... (or "
                        "nothing, for the default group). A DeviceMesh is for torch's "
                        "torch.distributed.fsdp.fully_shard on shoal's torch backend (docs/torch-backend.md)")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already called on this {type(module).__name__}")
    ignored = {id(param) for param in ignored_params or ()}
    parameters = _parameters(module, ignored)
    sharded = ShardGroup(parameters, _group_to_shard_over(group))
    for *_, param in parameters:
        param._shoal_sharded = True  # replaced by shards here: another module that holds it shares it
    cls = type(module)
    if cls not in _classes:
        _classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _classes[cls]
    module._shoal_shards = _Sharding(module, sharded, reshard_after_forward)
    module._join_config = _JoinConfig.construct_disabled_join_config()  # what a Joinable's constructor sets
    return module
