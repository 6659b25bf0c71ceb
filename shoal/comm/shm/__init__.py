"""Memory shared by the ranks of one host: named regions (region.py), lanes that carry a link's large frames
past the kernel's socket copies (lanes.py), sleeping on a word of shared memory (futex.py), and the arena in
which a group's ranks on one host run their collectives in rounds (arena.py)."""

from shoal.comm.shm.arena import Arena
from shoal.comm.shm.lanes import Inbound, Outbound
from shoal.comm.shm.region import Region, available

__all__ = ["Arena", "Inbound", "Outbound", "Region", "available"]
