"""The job's store with no single point of failure: each launcher of a `shoal run --live` job keeps a
replica (replica.py), one of them the primary, and clients (client.py) follow whichever replica is the
primary now. What every replica holds, and how it changes, is state.py's; the messages, wire.py's."""

from shoal.comm.replicated_store.client import ReplicatedStore
from shoal.comm.replicated_store.replica import StoreReplica

__all__ = ["ReplicatedStore", "StoreReplica"]
