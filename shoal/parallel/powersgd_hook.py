"""PowerSGD (Vogels et al., https://arxiv.org/abs/1905.13727): DistributedDataParallel sends each gradient
matrix of a bucket as two thin factors P (n x r) and Q (m x r) instead of its n x m values, found by one
step of power iteration warm-started from the last step's Q; what the approximation misses is kept and
added to the next step's gradient (error feedback), so nothing is lost, only delayed. torch's PowerSGDState
and powerSGD_hook, with the same arguments and, for the same inputs, the same results.

    state = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=100)
    model.register_comm_hook(state, powerSGD_hook)

Per bucket, two all-reduces where torch's makes three: the uncompressed tensors (vectors, and matrices too
small to gain) travel with P, then Q. `batched_powerSGD_hook` is torch's simpler variant: the whole bucket as
one square matrix. Under LiveTraining, pass the state as `extra={"powersgd": state}`:
every generation then starts from rank 0's step count, random generator and Qs, so a joiner projects as
the others do.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.backends.group import ProcessGroup
from shoal.parallel.comm_hooks import GradBucket, Pending, _divide_then_sum

logger = logging.getLogger(__name__)


class PowerSGDState:
    """The hook's settings and its memory across steps, torch's PowerSGDState. `start_powerSGD_iter`
    backward passes are averaged whole before compression starts: early gradients are the ones a low-rank
    approximation hurts most. A matrix is compressed only if its factors are `min_compression_rate` times
    smaller than it. `process_group` None is the DDP's group (torch's: the default group, the same in
    plain use; under LiveTraining, the current generation's)."""

    __slots__ = ("batch_tensors_with_same_shape", "compression_stats_logging_frequency", "error_dict", "iter",
                 "matrix_approximation_rank", "min_compression_rate", "next_stats_report", "orthogonalization_epsilon",
                 "p_memory_dict", "process_group", "q_memory_dict", "rng", "start_powerSGD_iter",
                 "total_numel_after_compression", "total_numel_before_compression", "use_error_feedback", "warm_start")

    def __init__(self, process_group: ProcessGroup | None, matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 1_000, min_compression_rate: float = 2, use_error_feedback: bool = True,
                 warm_start: bool = True, orthogonalization_epsilon: float = 0, random_seed: int = 0,
                 compression_stats_logging_frequency: int = 10_000, batch_tensors_with_same_shape: bool = False
                 ) -> None:
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError("Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, "
                             f"got start_powerSGD_iter={start_powerSGD_iter}: the memory they keep per bucket is "
                             f"made once DDP's buckets are settled, after its first two iterations")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        # Draws one seed per fresh set of Qs, in the same order on every replica (numpy's, as torch's: the
        # same seed gives the same projections as torch's hook).
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict[int, torch.Tensor] = {}  # bucket index -> what compression missed last time
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.next_stats_report = 0
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count a backward pass at its last bucket."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                logger.info("Start to apply PowerSGD after %s iterations.", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """(elements before / after compression, elements before, elements after), over every step so far."""
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after > 0 else 0, before, after)

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the process group, which cannot be pickled (torch's does the same)."""
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot != "process_group"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None  # the DDP's group
        for slot, value in state.items():
            setattr(self, slot, value)

    def state_dict(self) -> dict[str, Any]:
        """What the replicas hold alike (LiveTraining hands rank 0's to every member of a new generation): the
        step count, the random generator, P and Q. Not the error feedback, which is each replica's own. Plain
        types and tensors only, as torch.load(weights_only=True) reads."""
        kind, keys, position, has_gauss, gauss = self.rng.get_state()
        return {"iter": self.iter, "next_stats_report": self.next_stats_report,
                "rng": (kind, keys.tolist(), position, has_gauss, gauss),
                "p_memory_dict": dict(self.p_memory_dict), "q_memory_dict": dict(self.q_memory_dict)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iter, self.next_stats_report = state["iter"], state["next_stats_report"]
        kind, keys, position, has_gauss, gauss = state["rng"]
        self.rng.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, gauss))
        self.p_memory_dict = {index: p.clone() for index, p in state["p_memory_dict"].items()}
        self.q_memory_dict = {index: q.clone() for index, q in state["q_memory_dict"].items()}


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> Pending:
    """Average the bucket whole during warm-up, then as low-rank factors with error feedback (see the module)."""
    group = state.process_group if state.process_group is not None else bucket.group
    flat = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return Pending(_divide_then_sum(flat, group), bucket.buffer)
    index = bucket.index()
    sent = None
    if state.use_error_feedback:
        if index in state.error_dict:
            flat.add_(state.error_dict[index])
        else:
            state.error_dict[index] = torch.zeros_like(flat)
        sent = flat.clone()
    matrices, plain = _sort_by_compression(state, bucket)
    stacks = _stacks(matrices, state.batch_tensors_with_same_shape)
    ps, qs = _factors(state, index, stacks, flat)
    for matrix, q, p in zip(stacks, qs, ps, strict=True):
        torch.bmm(matrix, q, out=p)
    p_memory, q_memory = state.p_memory_dict[index], state.q_memory_dict[index]
    # The uncompressed tensors and P in one all-reduce: a sum for both.
    packed = torch.cat([*(t.reshape(-1) for t in plain), p_memory])
    work = group.all_reduce(packed, ReduceOp.SUM)

    def decompress() -> torch.Tensor:
        size, start = group.size, 0
        for tensor in plain:
            tensor.copy_(packed[start:start + tensor.numel()].view_as(tensor)).div_(size)
            start += tensor.numel()
        p_memory.copy_(packed[start:])
        for p in ps:
            _orthogonalize(p, state.orthogonalization_epsilon)
        for matrix, p, q in zip(stacks, ps, qs, strict=True):
            torch.bmm(matrix.transpose(1, 2), p, out=q)
        if q_memory.numel():  # a bucket of vectors only has no factors (every replica's buckets are alike)
            group.all_reduce(q_memory, ReduceOp.SUM).wait()
            q_memory.div_(size)
        for p, q, matrix in zip(ps, qs, stacks, strict=True):
            torch.bmm(p, q.transpose(1, 2), out=matrix)
        if state.batch_tensors_with_same_shape:  # stacks of several are copies: write them back
            for stack, originals in zip(stacks, matrices.values(), strict=True):
                for i, original in enumerate(originals if len(originals) > 1 else ()):
                    original.copy_(stack[i])
        if sent is not None:
            state.error_dict[index] = sent - flat
        if not state.warm_start:  # this bucket's only: later buckets may be in flight with theirs
            del state.p_memory_dict[index], state.q_memory_dict[index]
        state.maybe_increase_iter(bucket)
        return flat
    return Pending(work, decompress)


def batched_powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> Pending:
    """PowerSGD of the bucket as one matrix, torch's batched_powerSGD_hook: the flat gradients, padded with
    zeros to a square, sent as one pair of factors: three products a bucket however many layers it holds,
    but usually far less accurate than `powerSGD_hook`, as one layer's gradients are approximated together
    with another's (torch advises rank 1). Unlike torch's, it honours `orthogonalization_epsilon`, and a rank
    above the square's side is cut to it."""
    group = state.process_group if state.process_group is not None else bucket.group
    flat = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return Pending(_divide_then_sum(flat, group), bucket.buffer)
    index, length = bucket.index(), flat.numel()
    side = math.ceil(math.sqrt(length))
    state.total_numel_before_compression += length
    state.total_numel_after_compression += 2 * side * min(side, state.matrix_approximation_rank)
    _report_stats(state, bucket)
    square = flat.new_zeros(side * side)
    square[:length] = flat
    sent = None
    if state.use_error_feedback:  # the padding keeps its error too, as torch's does
        if index in state.error_dict:
            square.add_(state.error_dict[index])
        sent = square.clone()
    matrix = square.view(side, side)
    ps, qs = _factors(state, index, [matrix.unsqueeze(0)], flat)
    p, q = ps[0][0], qs[0][0]  # 2-D views of the bucket's factors
    torch.matmul(matrix, q, out=p)
    work = group.all_reduce(p, ReduceOp.SUM)

    def decompress() -> torch.Tensor:
        _orthogonalize(p.unsqueeze(0), state.orthogonalization_epsilon)
        torch.matmul(matrix.t(), p, out=q)
        group.all_reduce(q, ReduceOp.SUM).wait()
        q.div_(group.size)
        torch.matmul(p, q.t(), out=matrix)
        if sent is not None:
            state.error_dict[index] = sent - square
        if not state.warm_start:
            del state.p_memory_dict[index], state.q_memory_dict[index]
        state.maybe_increase_iter(bucket)
        return flat.copy_(square[:length])
    return Pending(work, decompress)


def _sort_by_compression(state: PowerSGDState, bucket: GradBucket
                         ) -> tuple[dict[torch.Size, list[torch.Tensor]], list[torch.Tensor]]:
    """The bucket's gradients worth compressing, as matrices (first dimension by the rest) grouped by shape
    in order of first appearance, the order their factors lie in memory; and the others. Counts both in the
    compression statistics."""
    matrices: dict[torch.Size, list[torch.Tensor]] = defaultdict(list)
    plain = []
    for tensor in bucket.gradients():
        matrix = tensor.view(tensor.shape[0], -1)
        n, m = matrix.shape
        compressed = (n + m) * min(n, m, state.matrix_approximation_rank)
        state.total_numel_before_compression += n * m
        if compressed * state.min_compression_rate < n * m:
            matrices[matrix.shape].append(matrix)
            state.total_numel_after_compression += compressed
        else:
            plain.append(tensor)
            state.total_numel_after_compression += n * m
    _report_stats(state, bucket)
    return matrices, plain


def _report_stats(state: PowerSGDState, bucket: GradBucket) -> None:
    """Log the compression statistics at the last bucket of a backward pass, when they are due."""
    if bucket.is_last() and state.iter >= state.next_stats_report:
        rate, before, after = state.compression_stats()
        logger.info("Compression stats: iter %s, total before compression %s, total after compression %s, rate %s",
                    state.iter, before, after, rate)
        state.next_stats_report = state.iter + state.compression_stats_logging_frequency


def _stacks(matrices: dict[torch.Size, list[torch.Tensor]], batched: bool) -> list[torch.Tensor]:
    """Batches of matrices for torch.bmm: each alone (a view of the bucket), or those of one shape stacked
    (a copy, written back after decompression)."""
    if batched:
        return [group[0].unsqueeze(0) if len(group) == 1 else torch.stack(group) for group in matrices.values()]
    return [matrix.unsqueeze(0) for group in matrices.values() for matrix in group]


def _factors(state: PowerSGDState, index: int, stacks: list[torch.Tensor], flat: torch.Tensor
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Views of the bucket's P and Q memory, one (batch, rows or columns, rank) per stack. The Qs are last
    step's, orthogonalized (warm start), or fresh random ones, the same on every replica."""
    shapes = [(b, n, m, min(n, m, state.matrix_approximation_rank)) for b, n, m in (s.shape for s in stacks)]
    for memory in (state.p_memory_dict, state.q_memory_dict):
        if index in memory and memory[index].device != flat.device:  # handed over on the CPU (LiveTraining)
            memory[index] = memory[index].to(flat.device)
    fresh = not state.warm_start or index not in state.p_memory_dict
    if fresh:
        state.p_memory_dict[index] = flat.new_empty(sum(b * n * r for b, n, _, r in shapes))
        state.q_memory_dict[index] = flat.new_empty(sum(b * m * r for b, _, m, r in shapes))
    ps, qs, p_at, q_at = [], [], 0, 0
    for b, n, m, r in shapes:
        ps.append(state.p_memory_dict[index][p_at:p_at + b * n * r].view(b, n, r))
        qs.append(state.q_memory_dict[index][q_at:q_at + b * m * r].view(b, m, r))
        p_at, q_at = p_at + b * n * r, q_at + b * m * r
    if fresh:
        # Drawn on the CPU from one seed per bucket, as torch's are, so that any device gets the same values.
        generator = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
        for q in qs:
            q.copy_(torch.randn(*q.shape, generator=generator, dtype=q.dtype))
    for q in qs:
        _orthogonalize(q, state.orthogonalization_epsilon)
    return ps, qs


def _orthogonalize(matrices: torch.Tensor, epsilon: float) -> None:
    """Make the columns of each matrix in the batch orthonormal, in place: Gram-Schmidt for one or two columns
    or half precision (which QR lacks), QR otherwise. `epsilon` keeps a column of zeros from dividing by
    zero."""
    columns = matrices.shape[2]
    if columns > 2 and matrices.dtype not in (torch.float16, torch.bfloat16):
        matrices.copy_(torch.linalg.qr(matrices).Q)
        return
    for i in range(columns):
        column = matrices[:, :, i:i + 1]
        column /= torch.norm(column, dim=1, keepdim=True) + epsilon
        if i + 1 < columns:
            rest = matrices[:, :, i + 1:]
            rest -= torch.sum(column * rest, dim=1, keepdim=True) * column
