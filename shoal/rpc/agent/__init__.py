"""The RPC agent: one worker's end of the RPC group, in pieces of one concept each.

`lifecycle.py` holds `RpcAgent`, which starts, names the workers, answers a worker's death and shuts
down; it calls out through `calls.py`, serves the other workers' requests through `serving.py`, and
sends and runs notices through `notices.py` (riding on other messages: `riders.py`). `running.py`
runs functions and callbacks on the threads of `pool.py`; `outstanding.py` tracks the calls this
worker waits on, each failed at its deadline by `deadlines.py`; `wire.py` moves whole messages over
the transport.
"""

from shoal.rpc.agent.calls import Caller
from shoal.rpc.agent.deadlines import Deadlines
from shoal.rpc.agent.lifecycle import RpcAgent
from shoal.rpc.agent.notices import Notices
from shoal.rpc.agent.outstanding import Call, Outstanding
from shoal.rpc.agent.pool import WorkerPool
from shoal.rpc.agent.riders import Riders
from shoal.rpc.agent.running import Runner
from shoal.rpc.agent.serving import Server
from shoal.rpc.agent.wire import INLINE_BYTES, RPC_GROUP, Wire

__all__ = [
    "INLINE_BYTES",
    "RPC_GROUP",
    "Call",
    "Caller",
    "Deadlines",
    "Notices",
    "Outstanding",
    "Riders",
    "RpcAgent",
    "Runner",
    "Server",
    "Wire",
    "WorkerPool",
]
