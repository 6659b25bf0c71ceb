"""What every replica of the store holds, and the one way it changes: `apply`, which gives the same result
on every replica that holds the same state, so the primary's changes replayed in order on a follower leave
it equal. A change a client sends again (its reply was lost with a primary) is answered from `done`."""

from __future__ import annotations

from typing import Any

from shoal.comm.replicated_store.wire import pack, unpack

CHANGES = frozenset({"set", "add", "compare_set", "delete", "replicas", "beat"})


class StoreState:
    def __init__(self, replicas: list[str], term: int = 0, store_id: str | None = None) -> None:
        self.data: dict[str, bytes] = {}
        self.done: dict[str, list[Any]] = {}  # client -> [its last change's number, the result]
        self.replicas = replicas
        """Addresses of the replicas, the primary first, then its followers in the order they came."""
        self.term = term
        """How many times a follower has taken over as primary: a client never goes back to an older term."""
        self.store_id = store_id
        """Drawn by the first primary: a replica or client of the job refuses a store of another id (a new,
        empty primary on a lost one's address). None in a follower until it holds the state."""

    def apply(self, change: dict[str, Any]) -> Any:
        op = change["op"]
        if op == "beat":
            return None
        if op == "replicas":
            self.replicas = change["replicas"]
            return None
        last = self.done.get(change["client"])
        if last is not None and last[0] == change["seq"]:
            return last[1]
        key, data = change.get("key"), self.data
        if op == "set":
            data[key] = unpack(change["value"])
            result = None
        elif op == "add":
            result = int(data.get(key, b"0")) + change["amount"]
            data[key] = str(result).encode()
        elif op == "compare_set":
            current, expected, desired = data.get(key), unpack(change["expected"]), unpack(change["desired"])
            if current == expected or (current is None and expected == b""):
                data[key] = current = desired
            result = pack(expected if current is None else current)
        else:  # delete
            result = data.pop(key, None) is not None
        self.done[change["client"]] = [change["seq"], result]
        return result

    def read(self, request: dict[str, Any]) -> Any:
        op = request["op"]
        if op == "get":
            value = self.data.get(request["key"])
            return None if value is None else pack(value)
        if op == "check":
            return all(key in self.data for key in request["keys"])
        if op == "num_keys":
            return len(self.data)
        raise ValueError(f"the store has no operation {op!r}")

    def snapshot(self) -> dict[str, Any]:
        return {"data": {k: pack(v) for k, v in self.data.items()}, "done": self.done, "replicas": self.replicas,
                "term": self.term, "store": self.store_id}

    @classmethod
    def restore(cls, snapshot: dict[str, Any]) -> StoreState:
        state = cls(snapshot["replicas"], snapshot["term"], snapshot["store"])
        state.data = {k: unpack(v) for k, v in snapshot["data"].items()}
        state.done = snapshot["done"]
        return state
