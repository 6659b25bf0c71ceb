"""`ZeroRedundancyOptimizer`: ZeRO stage 1 (https://arxiv.org/abs/1910.02054), torch.distributed.optim's
interface over shoal's groups. Each rank keeps the optimizer state of its shard of the parameters only; a
step updates that shard, then every parameter is broadcast from the rank that owns it.

    ddp = DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    loss_fn(ddp(x), y).backward()
    opt.step()                       # Adam's moments live on the owner of each parameter only
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

import shoal.distributed as dist
from shoal.parallel.join import Join, Joinable, JoinHook

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wraps a local `optimizer_class` that steps this rank's shard of `params`; torch's arguments and semantics.

    The parameters are partitioned as torch partitions them: each param group's parameters, largest first,
    go one by one to the rank with the fewest elements so far (counted over all groups). `self.optim` is the
    local optimizer, built with this rank's share of every group and `**defaults`; `param_groups` are all
    the parameters' groups, kept in step with the local ones (a learning-rate scheduler may change them).
    With `parameters_as_bucket_view=True`, each rank's parameters on one device become views into one
    flat bucket, so a step broadcasts one tensor per rank and device instead of one per parameter.

    Use `consolidate_state_dict(to)` on every rank, then `state_dict()` on rank `to`, to save; every rank
    loads the whole state dict with `load_state_dict` and keeps its shard of it. A Joinable: under
    `shoal.parallel.Join` (`Join([ddp, zero])`, or alone) a rank out of inputs keeps stepping its shard with
    its last gradients and broadcasting it, as torch's does, so the live ranks do not hang.
    `overlap_with_ddp=True` is not supported: it raises NotImplementedError.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], optimizer_class: type[Optimizer],
                 process_group: Any | None = None, parameters_as_bucket_view: bool = False,
                 overlap_with_ddp: bool = False, **defaults: Any) -> None:
        params = _checked_params(params)
        if overlap_with_ddp:
            raise NotImplementedError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) is not supported by shoal: it needs torch's DDP "
                "communication hook hook_with_zero_step and DDP's bucket rebuilding, which shoal's "
                "DistributedDataParallel does not have. Pass overlap_with_ddp=False (the default) and call step() "
                "after backward; parameters_as_bucket_view=True makes its broadcasts one per rank")
        _refuse_functional(optimizer_class)
        # Optimizer's constructor calls add_param_group, whose re-partitioning waits for the local optimizer.
        self.initialized = False
        Optimizer.__init__(self, params, defaults)
        Joinable.__init__(self)
        _check_groups(self.param_groups)
        self.process_group = process_group if process_group is not None else dist.default_group()
        self.world_size: int = dist.get_world_size(self.process_group)
        self.rank: int = dist.get_rank(self.process_group)
        if self.rank < 0:
            raise ValueError("ZeroRedundancyOptimizer: this rank is not a member of process_group (new_group gave "
                             "it GroupMember.NON_GROUP_MEMBER); create the optimizer on the group's members only")
        self.global_rank: int = dist.get_global_rank(self.process_group, self.rank)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._optim_defaults = defaults
        self._optim_constructor = optimizer_class
        self._default_device = self._all_params[0].device
        self._partition_cache: list[list[dict[str, Any]]] | None = None
        self._is_trainable_mask = self._trainable_mask()
        # Handing it groups, not a list, lets a rank with no parameters in a group still build its optimizer.
        self.optim: Optimizer = optimizer_class(self._partition_parameters()[self.rank], **defaults)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        self._buckets: list[list[torch.Tensor | None]] = []  # [device][rank]: None where a rank has none there
        self._build_param_buckets()
        self._all_state_dicts: list[dict[str, Any]] = []  # filled on the target of consolidate_state_dict
        self.initialized = True

    # ---- the partition --------------------------------------------------------------------------

    @property
    def _all_params(self) -> list[torch.Tensor]:
        """Every parameter, in the global order of the state dict's indices."""
        return [p for group in self.param_groups for p in group["params"]]

    def _partition_parameters(self) -> list[list[dict[str, Any]]]:
        """Each rank's param groups (one per global group, maybe empty), as torch partitions them."""
        if self._partition_cache is None:
            self._partition_cache = partition_parameters(self.param_groups, self.world_size)
        return self._partition_cache

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for p in self._all_params]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, on every rank alike: the new group's parameters are partitioned after the
        others (those keep their ranks), and this rank's share joins the local optimizer as a new group."""
        super().add_param_group(param_group)
        if not self.initialized:
            return
        try:
            _check_groups(self.param_groups)
        except ValueError:
            self.param_groups.pop()
            raise
        self._partition_cache = None
        self.optim.add_param_group(self._partition_parameters()[self.rank][-1])
        self._sync_param_groups(self.optim.param_groups, self.param_groups)  # the local class's defaults
        self._is_trainable_mask = self._trainable_mask()
        self._build_param_buckets()

    def _build_param_buckets(self) -> None:
        """With parameters_as_bucket_view: per device and rank, one flat tensor that the rank's trainable
        parameters there become views of. A frozen parameter gets storage of its own: no rank updates it."""
        if not self.parameters_as_bucket_view:
            return
        by_device: dict[torch.device, list[list[torch.Tensor]]] = {}
        for rank, groups in enumerate(self._partition_parameters()):
            for group in groups:
                for param in group["params"]:
                    by_device.setdefault(param.device, [[] for _ in range(self.world_size)])[rank].append(param)
        self._buckets = []
        for device, per_rank in by_device.items():
            row: list[torch.Tensor | None] = []
            for params in per_rank:
                for param in params:
                    if not param.requires_grad:
                        param.data = param.data.detach().clone()  # out of an earlier bucket, if in one
                trainable = [p for p in params if p.requires_grad]
                if not trainable:
                    row.append(None)  # every rank knows: nothing to broadcast (torch sends a dummy element)
                    continue
                bucket = torch.empty(sum(p.numel() for p in trainable), dtype=trainable[0].dtype, device=device)
                offset = 0
                for param in trainable:
                    view = bucket[offset:offset + param.numel()]
                    view.copy_(param.data.flatten())
                    param.data = view.view_as(param.data)
                    offset += param.numel()
                row.append(bucket)
            self._buckets.append(row)

    # ---- stepping -----------------------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        """Step this rank's shard with the local optimizer (`closure` and `kwargs` go to it), then give every
        rank every shard; every rank must call it. Returns the local optimizer's loss."""
        Join.notify_join_context(self)
        loss = self._local_step(closure, **kwargs)
        self._sync_params()
        return loss

    def _local_step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        mask = self._trainable_mask()
        if mask != self._is_trainable_mask:
            warnings.warn("ZeroRedundancyOptimizer: the trainable parameters changed (requires_grad); the "
                          "parameter buckets are rebuilt", stacklevel=3)
            self._build_param_buckets()
            self._is_trainable_mask = mask
        self._sync_param_groups(self.param_groups, self.optim.param_groups)  # a scheduler's new lr, say
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        return loss

    def _shard_tensors(self, rank: int) -> list[torch.Tensor]:
        """What `rank` broadcasts after a step: its buckets, or each of its parameters."""
        if self.parameters_as_bucket_view:
            return [row[rank] for row in self._buckets if row[rank] is not None]
        return [p.detach() for group in self._partition_parameters()[rank] for p in group["params"]]

    def _sync_params(self) -> None:
        """Broadcast each rank's shard from it, all started in the same order on every rank, then waited for."""
        works = [dist.broadcast(tensor, group=self.process_group, async_op=True, group_src=rank)
                 for rank in range(self.world_size) for tensor in self._shard_tensors(rank)]
        for work in works:
            work.wait()

    @staticmethod
    def _sync_param_groups(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
        """Copy every setting but the parameters from `source`'s groups to `target`'s, group by group."""
        assert len(source) == len(target), f"{len(source)} param groups against {len(target)}"
        for src, dst in zip(source, target, strict=True):
            dst.update({key: value for key, value in src.items() if key != "params"})

    # ---- state dicts -------------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's local state dict (on the CPU) on group rank `to`, for `state_dict()` there;
        every rank must call it. The others forget what an earlier consolidation gave them."""
        if not 0 <= to < self.world_size:
            raise ValueError(f"consolidate_state_dict: to={to} is not a rank of this group of {self.world_size}")
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        local = _to_cpu(self.optim.state_dict())
        gathered: list[Any] | None = [None] * self.world_size if self.rank == to else None
        dist.gather_object(local, gathered, group=self.process_group, group_dst=to)
        self._all_state_dicts = gathered if gathered is not None else []

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state dict, as one torch optimizer over all the parameters would give it,
        from the last `consolidate_state_dict` to this rank; raises RuntimeError if there was none."""
        if not self._all_state_dicts:
            raise RuntimeError("Optimizer state has not been consolidated on this rank. Please call "
                               f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you meant to "
                               "save the global state.")
        state_dict = super().state_dict()
        index = {param: i for i, param in enumerate(self._all_params)}
        for rank, local in enumerate(self._all_state_dicts):
            groups = self._partition_parameters()[rank]
            if len(local["param_groups"]) != len(groups):
                raise RuntimeError(f"the state consolidated from rank {rank} has {len(local['param_groups'])} "
                                   f"param groups, the optimizer now {len(groups)}: call consolidate_state_dict "
                                   f"again after add_param_group")
            for local_group, group in zip(local["param_groups"], groups, strict=True):
                for local_index, param in zip(local_group["params"], group["params"], strict=True):
                    if local_index in local["state"]:
                        state_dict["state"][index[param]] = local["state"][local_index]
        state_dict["state"] = dict(sorted(state_dict["state"].items()))
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state dict (from `state_dict()`, torch's ZeroRedundancyOptimizer's, or a plain optimizer's
        over the same groups): the settings into every group, the state of this rank's shard into the local
        optimizer. `state_dict` is left as it is (torch's clears the other ranks' entries in it)."""
        # The base class checks the groups and takes their settings; handed no state, it keeps none here.
        super().load_state_dict({**state_dict, "state": {}})
        index = {param: i for i, param in enumerate(self._all_params)}
        local_state, local_groups, count = {}, [], 0
        for saved, group in zip(state_dict["param_groups"], self._partition_parameters()[self.rank], strict=True):
            local_indices = []
            for param in group["params"]:
                if index[param] in state_dict["state"]:
                    local_state[count] = state_dict["state"][index[param]]
                local_indices.append(count)
                count += 1
            local_groups.append({**saved, "params": local_indices})
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self._sync_param_groups(self.param_groups, self.optim.param_groups)

    # ---- Joinable ------------------------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """While joined, each of the live ranks' steps is shadowed by a step of this rank's shard (with the
        gradients it has: set them as needed) and its broadcasts. Takes no keyword arguments of its own."""
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._default_device

    @property
    def join_process_group(self) -> Any:
        return self.process_group


class _ZeroJoinHook(JoinHook):
    """A joined rank's part in each live step: its own shard's step and broadcasts."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        # step() without its notification of the join context: a joined rank is not live (torch's hook calls
        # step(), which hangs when the optimizer is the first Joinable; later ones notify nothing anyway).
        self.zero._local_step()
        self.zero._sync_params()


def partition_parameters(param_groups: list[dict[str, Any]], world_size: int) -> list[list[dict[str, Any]]]:
    """torch's sorted-greedy partition: for each group in order, its parameters by size (largest first,
    ties in their order) each go to the first rank with the fewest elements so far. Returns per rank one
    copy of every group holding that rank's parameters."""
    per_rank: list[list[dict[str, Any]]] = [[] for _ in range(world_size)]
    sizes = [0] * world_size
    for group in param_groups:
        assigned: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        for param in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            rank = sizes.index(min(sizes))
            assigned[rank].append(param)
            sizes[rank] += param.numel()
        for rank, params in enumerate(assigned):
            per_rank[rank].append({**group, "params": params})
    return per_rank


def _checked_params(params: Any) -> list[Any]:
    """`params` as a list of tensors or of param groups, with torch's errors for anything else."""
    if isinstance(params, torch.Tensor):
        raise TypeError(f"`params` argument should be an iterable of Tensors, but got {torch.typename(params)}")
    try:
        params = list(params)
    except TypeError as exc:
        raise TypeError(f"`params` argument should be an iterable of Tensors or dicts, but got "
                        f"{torch.typename(params)}") from exc
    if not params:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if all(isinstance(p, dict) for p in params):
        for group in params:
            if "params" not in group:
                raise ValueError("Each parameter group passed-in via `params` must have a 'params' key mapping to "
                                 "the parameters in the group")
    elif not all(isinstance(p, torch.Tensor) for p in params):
        raise TypeError("`params` argument should be an iterable of Tensors or dicts")
    return params


def _check_groups(groups: list[dict[str, Any]]) -> None:
    """torch's rule: one dense tensor type (dtype and device type) for all parameters, which a bucket needs.
    Named parameters, which torch's ZeroRedundancyOptimizer fails on, are refused."""
    if any("param_names" in group for group in groups):
        raise ValueError("ZeroRedundancyOptimizer does not support named parameters ((name, tensor) pairs): "
                         "pass the tensors")
    params = [p for group in groups for p in group["params"]]
    typename = torch.typename(params[0])
    if params[0].is_sparse:
        raise ValueError(f"ZeroRedundancyOptimizer only supports using the same dense type for all parameters "
                         f"but got {typename}")
    for param in params[1:]:
        if torch.typename(param) != typename:
            raise ValueError(f"ZeroRedundancyOptimizer only supports using the same dense type for all parameters "
                             f"but got both {typename} and {torch.typename(param)}")


def _refuse_functional(optimizer_class: Any) -> None:
    """torch's functional optimizers go with overlap_with_ddp=True only, as in torch. Importing one imports
    torch.distributed.optim, and with it the table of them: a program that never did (importing it takes a
    second, for its TorchScript) holds none."""
    utils = sys.modules.get("torch.distributed.optim.utils")
    if utils is not None and optimizer_class in utils.functional_optim_map.values():
        raise ValueError(f"Passing in a functional optimizer {optimizer_class} when `overlap_with_ddp=False`")


def _to_cpu(value: Any) -> Any:
    """A copy of a state dict's structure with its tensors on the CPU (CPU tensors are not copied)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(item) for item in value)
    return value
