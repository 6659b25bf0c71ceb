"""The transport layer: authenticated links between the ranks of a group, which survive the loss of their
TCP connections. A frame carries an operation's identity (frame_header.py, frames.py) and lands straight in
the receive posted for it (matching.py); a link numbers, acknowledges and replays frames (link.py); the mesh
of links is one `Transport` (mesh.py), whose connections come up (connecting.py) through the job's store
(bring_up.py).

Layers above use it in two ways: collectives post receives and send frames for an `Op`; RPC serves a frame
group of its own (`Transport.serve`, `Transport.send_message`)."""

from shoal.comm.transport.auth import AuthenticationError
from shoal.comm.transport.bring_up import connect, listen
from shoal.comm.transport.frames import Op, Payload, Recv, SendTracker, Signature, as_bytes
from shoal.comm.transport.mesh import FrameHandler, Transport

__all__ = [
    "AuthenticationError",
    "FrameHandler",
    "Op",
    "Payload",
    "Recv",
    "SendTracker",
    "Signature",
    "Transport",
    "as_bytes",
    "connect",
    "listen",
]
