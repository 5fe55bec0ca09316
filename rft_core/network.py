"""This host's side of a rendezvous: a free TCP port for a process group's store to listen on
(the weight sync's ``TCPStore``, ``rft_core.weightsync.collective``; the single-rank world of a
DeepSpeed or FSDP2 update outside torchrun, ``rft_core.training.zero.init_distributed`` and
``rft_core.training.fsdp.init_process_group``; a resident gang's ``rendezvous``). A leaf: imports
nothing of the project."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port that is free on every interface of this host now (bound to port 0, read back
    and released: another process may take it before the caller binds it, as with any such probe).

    Raises:
        OSError: no socket can be bound.
    """
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
