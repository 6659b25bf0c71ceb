"""Tests for the collective algorithms of `shoal.comm.algorithms.ring`, run by threads over an in-process fake channel:
results are compared exactly with local references, and the frames each rank sends with the intended plan."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shoal.comm.algorithms import ring
from shoal.comm.algorithms.reduce_op import ReduceOp

_WAIT_S = 10.0
_JOIN_S = 20.0

Key = tuple[int, int, int]  # (src, dst, sub)
Send = tuple[int, int, int, int]  # (src, dst, sub, nbytes)

# "small" sends a few hundred bytes down the ring path, cut into chunks of a few dozen elements.
_THRESHOLDS = {"default": (ring.SMALL_BYTES, ring.CHUNK_BYTES), "small": (256, 192)}
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
_BITWISE = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}


def _ops_and_dtypes(dtypes: list[torch.dtype]) -> list[Any]:
    """Every reduce op with every dtype it takes (the bitwise ones take no floating point)."""
    return [pytest.param(op, dtype, id=f"{_dtype_id(dtype)}-{op.name}") for dtype in dtypes for op in ReduceOp
            if not (op in _BITWISE and dtype.is_floating_point)]


_ROOTED = [(size, root) for size in (1, 2, 3, 4) for root in range(size)]


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rooted(name: str, min_size: int = 1) -> list[Any]:
    return [pytest.param(size, root, id=f"n{size}-{name}{root}") for size, root in _ROOTED if size >= min_size]


class _Handle:
    """A posted receive: filled, then processed, then marked done, when its frame is delivered."""

    def __init__(self, key: Key, view: memoryview, process: Callable[[], None] | None) -> None:
        self.key = key
        self.view = view
        self.process = process
        self.done = threading.Event()
        self.error: BaseException | None = None

    def deliver(self, data: bytes) -> None:
        try:
            if len(data) != self.view.nbytes:
                raise ValueError(f"frame {self.key} has {len(data)} bytes, the receive posted {self.view.nbytes}")
            self.view[:] = data
            if self.process is not None:
                self.process()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()


class _Network:
    """Mailbox shared by the channels of one run, and the log of every send."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        self.frames: dict[Key, bytes] = {}  # sent, receive not posted yet
        self.posted: dict[Key, _Handle] = {}  # posted, frame not sent yet
        self.used: set[Key] = set()
        self.sends: list[Send] = []


class _FakeChannel:
    """`ring.Channel` of one rank. A send copies its bytes at once; a frame is delivered in the sender's thread
    when its receive is already posted, else in the poster's thread when the receive is posted."""

    def __init__(self, net: _Network, rank: int) -> None:
        self.rank, self.size = rank, net.size
        self._net = net

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"rank {self.rank}: bad peer {peer} in a group of {self.size}")

    def recv(self, src: int, sub: int, view: memoryview, process: Callable[[], None] | None = None) -> _Handle:
        self._check_peer(src)
        key = (src, self.rank, sub)
        handle = _Handle(key, view, process)
        with self._net.lock:
            if key in self._net.posted or (key in self._net.used and key not in self._net.frames):
                raise RuntimeError(f"receive {key} posted twice")
            self._net.used.add(key)
            data = self._net.frames.pop(key, None)
            if data is None:
                self._net.posted[key] = handle
                return handle
        handle.deliver(data)
        return handle

    def wait(self, handle: _Handle) -> None:
        if not handle.done.wait(_WAIT_S):
            raise TimeoutError(f"rank {self.rank}: frame {handle.key} never arrived")
        if handle.error is not None:
            raise handle.error

    def send(self, dst: int, sub: int, view: memoryview) -> None:
        self._check_peer(dst)
        key = (self.rank, dst, sub)
        data = bytes(view)
        with self._net.lock:
            self._net.sends.append((self.rank, dst, sub, len(data)))
            if key in self._net.frames or (key in self._net.used and key not in self._net.posted):
                raise RuntimeError(f"frame {key} sent twice")
            self._net.used.add(key)
            handle = self._net.posted.pop(key, None)
            if handle is None:
                self._net.frames[key] = data
                return
        handle.deliver(data)

    def flush(self) -> None:
        pass

    def scratch(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 0xA5, dtype=torch.uint8)  # garbage, so reading unreceived scratch shows


class _Ranks:
    """Long-lived daemon threads that run the ranks (starting threads for every test would cost more than most
    tests); workers still busy at a deadline are abandoned and replaced."""

    def __init__(self) -> None:
        self._queues: list[queue.SimpleQueue] = []

    @staticmethod
    def _work(jobs: queue.SimpleQueue) -> None:
        while True:
            job, done = jobs.get()
            try:
                job()
            finally:
                done.set()

    def run(self, jobs: list[Callable[[], None]], timeout: float) -> list[int]:
        """Run the jobs concurrently, one per worker; return the indices of those still running at the deadline."""
        while len(self._queues) < len(jobs):
            jobs_queue: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(jobs_queue,), name=f"fake-rank-{len(self._queues)}",
                             daemon=True).start()
            self._queues.append(jobs_queue)
        done = [threading.Event() for _ in jobs]
        for jobs_queue, job, event in zip(self._queues[:len(jobs)], jobs, done, strict=True):
            jobs_queue.put((job, event))
        deadline = time.monotonic() + timeout
        stuck = [i for i, event in enumerate(done) if not event.wait(max(0.0, deadline - time.monotonic()))]
        if stuck:
            self._queues = []
        return stuck


_RANKS = _Ranks()


def _run(size: int, body: Callable[[_FakeChannel], Any]) -> tuple[list[Any], list[Send]]:
    """Run `body` on every rank of a fresh fake group, each in its own thread; return the results and the sends."""
    net = _Network(size)
    results: list[Any] = [None] * size
    errors: dict[int, BaseException] = {}

    def job(rank: int) -> Callable[[], None]:
        def run() -> None:
            try:
                results[rank] = body(_FakeChannel(net, rank))
            except BaseException as exc:
                errors[rank] = exc
        return run

    stuck = _RANKS.run([job(rank) for rank in range(size)], _JOIN_S)
    if stuck:
        raise AssertionError(f"ranks {stuck} did not finish within {_JOIN_S:g}s")
    if errors:
        rank, error = next(iter(errors.items()))  # the first to fail; the others may only be waiting for it
        raise AssertionError(f"rank {rank} failed: {error!r}") from error
    assert not net.frames, f"frames sent but never received: {sorted(net.frames)}"
    assert not net.posted, f"receives posted but never satisfied: {sorted(net.posted)}"
    return results, net.sends


def _set_thresholds(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    small, chunk = _THRESHOLDS[name]
    monkeypatch.setattr(ring, "SMALL_BYTES", small)
    monkeypatch.setattr(ring, "CHUNK_BYTES", chunk)


def _inputs(size: int, numel: int, dtype: torch.dtype, op: ReduceOp, seed: int) -> list[torch.Tensor]:
    """Small integer-valued tensors whose reduction over up to four ranks is exact in `dtype`, in any order;
    signed types get negative values, so that integer AVG must round toward zero."""
    gen = torch.Generator().manual_seed(seed)
    if op == ReduceOp.PRODUCT:
        low, high = 1, 3
    else:
        low, high = (0 if dtype == torch.uint8 else -3), 4
    return [torch.randint(low, high, (numel,), generator=gen).to(dtype) for _ in range(size)]


def _reference(inputs: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """The reduction of the per-rank inputs, in rank order."""
    acc = inputs[0].clone()
    for other in inputs[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc = acc + other
        elif op == ReduceOp.PRODUCT:
            acc = acc * other
        elif op in _BITWISE:
            acc = _BITWISE[op](acc, other)
        elif op == ReduceOp.MIN:
            acc = torch.minimum(acc, other)
        else:
            acc = torch.maximum(acc, other)
    if op == ReduceOp.AVG:
        size = len(inputs)
        acc = acc / size if acc.is_floating_point() else torch.div(acc, size, rounding_mode="trunc")
    return acc


def _assert_same(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, f"{what}: {got.dtype}{tuple(got.shape)}"
    assert torch.equal(got, expected), f"{what}: got {got.tolist()[:16]}, expected {expected.tolist()[:16]}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _segment_lengths(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _from(sends: list[Send], rank: int) -> list[Send]:
    return [send for send in sends if send[0] == rank]


# ---- all_reduce --------------------------------------------------------------------------------------------------


def _check_all_reduce(inputs: list[torch.Tensor], op: ReduceOp) -> list[Send]:
    """All-reduce the inputs over len(inputs) ranks, check every rank against the reference, return the sends."""

    def body(ch: _FakeChannel) -> torch.Tensor:
        flat = inputs[ch.rank].clone()
        ring.all_reduce(ch, flat, op)
        return flat

    results, sends = _run(len(inputs), body)
    expected = _reference(inputs, op)
    for rank, got in enumerate(results):
        _assert_same(got, expected, f"rank {rank}")
        assert torch.equal(_bits(got), _bits(results[0])), f"rank {rank} differs bitwise from rank 0"
    return sends


@pytest.mark.parametrize(("op", "dtype"), _ops_and_dtypes(_DTYPES))
@pytest.mark.parametrize("numel", [0, 1, 7, 1031])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_all_reduce_matches_reference(monkeypatch: pytest.MonkeyPatch, size: int, numel: int, dtype: torch.dtype,
                                      op: ReduceOp) -> None:
    _set_thresholds(monkeypatch, "small")
    _check_all_reduce(_inputs(size, numel, dtype, op, seed=1000 * size + numel), op)


@pytest.mark.parametrize(("op", "dtype"), _ops_and_dtypes([torch.float32, torch.int64]))
@pytest.mark.parametrize("numel", [1, 2, 5])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_all_reduce_ring_with_empty_segments(monkeypatch: pytest.MonkeyPatch, size: int, numel: int,
                                             dtype: torch.dtype, op: ReduceOp) -> None:
    monkeypatch.setattr(ring, "SMALL_BYTES", 0)
    monkeypatch.setattr(ring, "CHUNK_BYTES", 8)
    sends = _check_all_reduce(_inputs(size, numel, dtype, op, seed=size + numel), op)
    assert sends and all(dst == (src + 1) % size for src, dst, _, _ in sends)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_all_reduce_default_thresholds_ring(size: int) -> None:
    numel = ring.SMALL_BYTES // 4 + 13
    sends = _check_all_reduce(_inputs(size, numel, torch.float32, ReduceOp.AVG, seed=size), ReduceOp.AVG)
    assert all(dst == (src + 1) % size for src, dst, _, _ in sends)


# ---- the other collectives ---------------------------------------------------------------------------------------

# Default thresholds take the direct path for the small sizes and the ring or chain in one chunk for the large
# one; small thresholds take the ring or chain in several chunks for a few hundred elements.
_SIZES = [pytest.param(name, numel, id=f"{name}-{numel}")
          for name, numel in [("default", 0), ("default", 5), ("default", 20000), ("small", 5), ("small", 389)]]


@pytest.mark.parametrize(("thresholds", "numel"), _SIZES)
@pytest.mark.parametrize(("size", "root"), _rooted("root"))
def test_broadcast(monkeypatch: pytest.MonkeyPatch, size: int, root: int, numel: int, thresholds: str) -> None:
    _set_thresholds(monkeypatch, thresholds)
    gen = torch.Generator().manual_seed(numel + root)
    inputs = [torch.randn(numel, generator=gen, dtype=torch.float64) for _ in range(size)]

    def body(ch: _FakeChannel) -> torch.Tensor:
        flat = inputs[ch.rank].clone()
        ring.broadcast(ch, flat, root)
        return flat

    results, _ = _run(size, body)
    for rank, got in enumerate(results):
        _assert_same(got, inputs[root], f"rank {rank}")


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MAX], ids=lambda op: op.name)
@pytest.mark.parametrize(("thresholds", "numel"), _SIZES)
@pytest.mark.parametrize(("size", "dst"), _rooted("dst"))
def test_reduce(monkeypatch: pytest.MonkeyPatch, size: int, dst: int, numel: int, op: ReduceOp,
                thresholds: str) -> None:
    _set_thresholds(monkeypatch, thresholds)
    inputs = _inputs(size, numel, torch.float32, op, seed=numel + dst)

    def body(ch: _FakeChannel) -> torch.Tensor:
        flat = inputs[ch.rank].clone()
        ring.reduce(ch, flat, op, dst)
        return flat

    results, _ = _run(size, body)
    for rank, got in enumerate(results):
        _assert_same(got, _reference(inputs, op) if rank == dst else inputs[rank], f"rank {rank}")


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN], ids=lambda op: op.name)
@pytest.mark.parametrize(("thresholds", "numel"),
                         [pytest.param(name, numel, id=f"{name}-{numel}") for name, numel in
                          [("default", 0), ("default", 3), ("default", 9000), ("small", 3), ("small", 70)]])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_reduce_scatter(monkeypatch: pytest.MonkeyPatch, size: int, numel: int, op: ReduceOp,
                        thresholds: str) -> None:
    _set_thresholds(monkeypatch, thresholds)
    inputs = [x.view(size, numel) for x in _inputs(size, size * numel, torch.int64, op, seed=size + numel)]
    originals = [x.clone() for x in inputs]

    def body(ch: _FakeChannel) -> torch.Tensor:
        out = torch.full((numel,), -7, dtype=torch.int64)
        ring.reduce_scatter(ch, out, list(inputs[ch.rank].unbind()), op)
        return out

    results, _ = _run(size, body)
    expected = _reference(originals, op)
    for rank, got in enumerate(results):
        _assert_same(got, expected[rank], f"rank {rank}")
        _assert_same(inputs[rank], originals[rank], f"rank {rank}'s blocks")


@pytest.mark.parametrize("whose", ["ours", "the next rank's"])
@pytest.mark.parametrize(("thresholds", "numel"), [("default", 9000), ("small", 70)])
@pytest.mark.parametrize("size", [2, 3])
def test_reduce_scatter_into_one_of_its_own_blocks(monkeypatch: pytest.MonkeyPatch, size: int, numel: int,
                                                  thresholds: str, whose: str) -> None:
    _set_thresholds(monkeypatch, thresholds)
    inputs = [x.view(size, numel) for x in _inputs(size, size * numel, torch.int64, ReduceOp.SUM, seed=numel)]
    expected = _reference([x.clone() for x in inputs], ReduceOp.SUM)

    def body(ch: _FakeChannel) -> torch.Tensor:
        blocks = list(inputs[ch.rank].unbind())
        out = blocks[ch.rank if whose == "ours" else (ch.rank + 1) % size]
        ring.reduce_scatter(ch, out, blocks, ReduceOp.SUM)
        return out.clone()

    results, _ = _run(size, body)
    for rank, got in enumerate(results):
        _assert_same(got, expected[rank], f"rank {rank}")


class _SendsOffScratch:
    """A channel that refuses to send from the scratch memory it handed out."""

    def __init__(self, ch: _FakeChannel) -> None:
        self._ch, self._scratch = ch, []
        self.rank, self.size, self.recv, self.wait, self.flush = ch.rank, ch.size, ch.recv, ch.wait, ch.flush

    def scratch(self, nbytes: int) -> torch.Tensor:
        self._scratch.append(self._ch.scratch(nbytes))
        return self._scratch[-1]

    def send(self, dst: int, sub: int, view: memoryview) -> None:
        at = torch.frombuffer(view, dtype=torch.uint8).data_ptr() if view.nbytes else 0
        if any(t.data_ptr() <= at < t.data_ptr() + t.nbytes for t in self._scratch):
            raise AssertionError(f"rank {self.rank} sent frame {sub} from scratch")
        self._ch.send(dst, sub, view)


@pytest.mark.parametrize(("thresholds", "numel"), [("default", 9000), ("small", 70)])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_reduce_scatter_that_spends_its_blocks_sends_nothing_from_scratch(
        monkeypatch: pytest.MonkeyPatch, size: int, numel: int, thresholds: str) -> None:
    """hierarchy.py receives a later piece into a piece's scratch while that piece's sends may be queued."""
    _set_thresholds(monkeypatch, thresholds)
    inputs = [x.view(size, numel) for x in _inputs(size, size * numel, torch.int64, ReduceOp.SUM, seed=numel)]
    expected = _reference([x.clone() for x in inputs], ReduceOp.SUM)

    def body(ch: _FakeChannel) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.int64)
        handles = ring.start_reduce_scatter(_SendsOffScratch(ch), out, list(inputs[ch.rank].unbind()), ReduceOp.SUM,
                                            spend_blocks=True)
        for handle in handles:
            ch.wait(handle)
        return out

    results, _ = _run(size, body)
    for rank, got in enumerate(results):
        _assert_same(got, expected[rank], f"rank {rank}")


@pytest.mark.parametrize(("thresholds", "numel"), _SIZES)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_all_gather(monkeypatch: pytest.MonkeyPatch, size: int, numel: int, thresholds: str) -> None:
    _set_thresholds(monkeypatch, thresholds)
    gen = torch.Generator().manual_seed(numel)
    inputs = [torch.randn(numel, generator=gen).to(torch.bfloat16) for _ in range(size)]

    def body(ch: _FakeChannel) -> list[torch.Tensor]:
        outs = [torch.full((numel,), float("nan"), dtype=torch.bfloat16) for _ in range(size)]
        ring.all_gather(ch, outs, inputs[ch.rank].clone())
        return outs

    results, _ = _run(size, body)
    for rank, outs in enumerate(results):
        for src in range(size):
            _assert_same(outs[src], inputs[src], f"rank {rank}, block {src}")


@pytest.mark.parametrize(("thresholds", "numel"), _SIZES)
@pytest.mark.parametrize(("size", "dst"), _rooted("dst"))
def test_gather(monkeypatch: pytest.MonkeyPatch, size: int, dst: int, numel: int, thresholds: str) -> None:
    _set_thresholds(monkeypatch, thresholds)
    inputs = [torch.arange(numel, dtype=torch.int32) * 10 + rank for rank in range(size)]

    def body(ch: _FakeChannel) -> list[torch.Tensor] | None:
        outs = [torch.full((numel,), -1, dtype=torch.int32) for _ in range(size)] if ch.rank == dst else None
        ring.gather(ch, outs, inputs[ch.rank].clone(), dst)
        return outs

    results, sends = _run(size, body)
    assert all(results[rank] is None for rank in range(size) if rank != dst)
    for src in range(size):
        _assert_same(results[dst][src], inputs[src], f"block {src}")
    assert sorted(sends) == [(src, dst, 0, numel * 4) for src in range(size) if src != dst]


@pytest.mark.parametrize(("thresholds", "numel"), _SIZES)
@pytest.mark.parametrize(("size", "src"), _rooted("src"))
def test_scatter(monkeypatch: pytest.MonkeyPatch, size: int, src: int, numel: int, thresholds: str) -> None:
    _set_thresholds(monkeypatch, thresholds)
    blocks = [torch.arange(numel, dtype=torch.float16) + 100 * rank for rank in range(size)]

    def body(ch: _FakeChannel) -> torch.Tensor:
        out = torch.full((numel,), -1, dtype=torch.float16)
        ring.scatter(ch, out, [block.clone() for block in blocks] if ch.rank == src else None, src)
        return out

    results, sends = _run(size, body)
    for rank, got in enumerate(results):
        _assert_same(got, blocks[rank], f"rank {rank}")
    assert sorted(sends) == [(src, dst, 0, numel * 2) for dst in range(size) if dst != src]


@pytest.mark.parametrize("thresholds", list(_THRESHOLDS))
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_all_to_all(monkeypatch: pytest.MonkeyPatch, size: int, thresholds: str) -> None:
    _set_thresholds(monkeypatch, thresholds)

    def block(src: int, dst: int) -> torch.Tensor:
        numel = (3 * src + 5 * dst) % 7 + (300 if src == dst else 0)
        return torch.arange(numel, dtype=torch.int64) + 1000 * src + dst

    def body(ch: _FakeChannel) -> list[torch.Tensor]:
        outs = [torch.full_like(block(src, ch.rank), -1) for src in range(size)]
        ring.all_to_all(ch, outs, [block(ch.rank, dst) for dst in range(size)])
        return outs

    results, sends = _run(size, body)
    for rank, outs in enumerate(results):
        for src in range(size):
            _assert_same(outs[src], block(src, rank), f"rank {rank}, block from {src}")
    assert sorted(sends) == sorted((src, dst, 0, block(src, dst).numel() * 8)
                                   for src in range(size) for dst in range(size) if src != dst)


@pytest.mark.parametrize("thresholds", list(_THRESHOLDS))
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_barrier(monkeypatch: pytest.MonkeyPatch, size: int, thresholds: str) -> None:
    _set_thresholds(monkeypatch, thresholds)
    arrived: list[int] = []
    lock = threading.Lock()

    def body(ch: _FakeChannel) -> list[int]:
        time.sleep(0.005 * ch.rank)
        with lock:
            arrived.append(ch.rank)
        ring.barrier(ch)
        with lock:
            return list(arrived)

    results, sends = _run(size, body)
    for rank, seen in enumerate(results):
        assert sorted(seen) == list(range(size)), f"rank {rank} left the barrier having seen only {seen}"
    assert sorted(sends) == [(src, dst, 0, 0) for src in range(size) for dst in range(size) if src != dst]


# ---- communication plans -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8], ids=_dtype_id)
@pytest.mark.parametrize("numel", [1031, 4099])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_all_reduce_ring_plan(monkeypatch: pytest.MonkeyPatch, size: int, numel: int, dtype: torch.dtype) -> None:
    _set_thresholds(monkeypatch, "small")
    esize = torch.empty(0, dtype=dtype).element_size()
    nbytes = numel * esize
    assert nbytes > ring.SMALL_BYTES
    sends = _check_all_reduce(_inputs(size, numel, dtype, ReduceOp.SUM, seed=numel), ReduceOp.SUM)

    lengths = _segment_lengths(numel, size)
    chunks = math.ceil(max(lengths) * esize / ring.CHUNK_BYTES)
    assert chunks > 1
    for rank in range(size):
        mine = _from(sends, rank)
        assert {dst for _, dst, _, _ in mine} == {(rank + 1) % size}, f"rank {rank} sent off the ring"
        assert len(mine) == 2 * (size - 1) * chunks, f"rank {rank} sent {len(mine)} frames"
        assert len({sub for _, _, sub, _ in mine}) == len(mine), f"rank {rank} reused a frame number"
        # reduce-scatter passes on every segment but our own, all-gather every one but our right neighbour's
        expected = (numel - lengths[rank]) * esize + (numel - lengths[(rank + 1) % size]) * esize
        sent = sum(frame for _, _, _, frame in mine)
        assert sent == expected, f"rank {rank} sent {sent} bytes, expected {expected}"
        assert abs(sent - 2 * (size - 1) / size * nbytes) <= 2 * esize


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32], ids=_dtype_id)
@pytest.mark.parametrize("numel", [1, 7, 1031])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_all_reduce_small_plan(size: int, numel: int, dtype: torch.dtype) -> None:
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    assert nbytes <= ring.SMALL_BYTES
    sends = _check_all_reduce(_inputs(size, numel, dtype, ReduceOp.MAX, seed=numel), ReduceOp.MAX)
    assert sorted(sends) == [(src, dst, 0, nbytes) for src in range(size) for dst in range(size) if src != dst]


def _broadcast_sends(size: int, root: int, data: torch.Tensor) -> list[Send]:
    def body(ch: _FakeChannel) -> torch.Tensor:
        flat = data.clone() if ch.rank == root else torch.zeros_like(data)
        ring.broadcast(ch, flat, root)
        return flat

    results, sends = _run(size, body)
    for rank, got in enumerate(results):
        _assert_same(got, data, f"rank {rank}")
    return sends


@pytest.mark.parametrize("numel", [97, 1031])
@pytest.mark.parametrize(("size", "root"), _rooted("root", min_size=2))
def test_broadcast_chain_plan(monkeypatch: pytest.MonkeyPatch, size: int, root: int, numel: int) -> None:
    _set_thresholds(monkeypatch, "small")
    nbytes = numel * 4
    assert nbytes > ring.SMALL_BYTES
    sends = _broadcast_sends(size, root, torch.arange(numel, dtype=torch.float32))
    chunks = math.ceil(nbytes / ring.CHUNK_BYTES)
    for position in range(size):
        rank = (root + position) % size
        mine = _from(sends, rank)
        if position == size - 1:
            assert not mine, f"rank {rank}, last in the chain, sent {mine}"
            continue
        assert {dst for _, dst, _, _ in mine} == {(rank + 1) % size}, f"rank {rank} sent off the chain"
        assert len(mine) == chunks, f"rank {rank} sent {len(mine)} frames"
        assert sum(frame for _, _, _, frame in mine) == nbytes


@pytest.mark.parametrize(("size", "root"), _rooted("root", min_size=2))
def test_broadcast_small_plan(size: int, root: int) -> None:
    sends = _broadcast_sends(size, root, torch.arange(7, dtype=torch.float32))
    assert sorted(sends) == [(root, dst, 0, 28) for dst in range(size) if dst != root]
