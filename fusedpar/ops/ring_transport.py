"""The rings' transports: lists of tensors passed around a ring, one list per rank the
transport plays. `GroupRing`: this rank's side of a `fusedpar.comm.Ring` over a process
group; `VirtualRing`: every rank in this process, the transfers replaced by copies (the
ring's exact launches, checkable and measurable on one device)."""

from fusedpar.comm import Ring


class GroupRing:
    """This rank's side of a ring over a process group: lists of one rank's tensors."""

    def __init__(self, pg, *, tag: int = 0):
        self._ring = Ring(pg, tag=tag)
        self.size = self._ring.size
        self.ranks = [self._ring.rank]

    def send_recv(self, per_rank):
        return [self._ring.send_recv(per_rank[0])]

    def wait(self):
        return [self._ring.wait()]


class VirtualRing:
    """`size` ranks in one process: rank r's send arrives at rank r + 1 as a copy.

    ``send_recv(per_rank)`` takes one list of tensors per rank (``ranks`` order) and
    copies them along the ring at once (the copies stand in for the transfers); ``wait``
    returns what each rank received. Misuse raises as `fusedpar.comm.Ring` does."""

    def __init__(self, size: int):
        self.size = size
        self.ranks = list(range(size))
        self._in_flight = None

    def send_recv(self, per_rank):
        if self._in_flight is not None:
            raise RuntimeError("VirtualRing.send_recv called again before wait()")
        if len(per_rank) != self.size:
            raise ValueError(f"VirtualRing: {len(per_rank)} ranks' tensors for {self.size} ranks")
        self._in_flight = [[t.clone() for t in per_rank[(r - 1) % self.size]] for r in self.ranks]
        return self._in_flight

    def wait(self):
        if self._in_flight is None:
            raise RuntimeError("VirtualRing.wait called with no send_recv in flight")
        received, self._in_flight = self._in_flight, None
        return received
