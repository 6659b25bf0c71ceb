"""Collective algorithms: reduction operators (reduce_op.py), the ring and direct exchanges over point-to-point
frames (ring.py), the same collectives in a host's shared memory (intrahost.py), which ranks share a host
(placement.py), and the path each collective takes given that (routing.py). They see tensors as whole
flat buffers (segments.py) and never touch a socket."""

from shoal.comm.algorithms.placement import Placement
from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.algorithms.segments import Segments

__all__ = ["Placement", "ReduceOp", "Segments"]
