"""`PortArgs`: where one server instance's processes meet. Apart from `ServerArgs` because the addresses are
not flags: they are made fresh at each start (a directory the launcher owns), and every process needs them."""

from __future__ import annotations

from dataclasses import dataclass

from srt.owned_dirs import make_owned_temp_dir, remove_stale_dirs

IPC_DIR_PREFIX = "srt-ipc-"


@dataclass(frozen=True)
class PortArgs:
    """ZMQ ipc:// endpoints in a per-server temporary directory; each PULL side binds, each PUSH connects."""

    ipc_dir: str
    scheduler_input: str
    detokenizer_input: str
    tokenizer_input: str

    def scheduler_input_for(self, dp_rank: int) -> str:
        """Each data-parallel scheduler has its own input socket."""
        return self.scheduler_input if dp_rank == 0 else f"{self.scheduler_input}-dp{dp_rank}"

    @classmethod
    def create(cls) -> PortArgs:
        """A fresh IPC directory (after removing those whose launcher was killed before it could)."""
        remove_stale_dirs(IPC_DIR_PREFIX)
        d = make_owned_temp_dir(IPC_DIR_PREFIX)
        return cls(d, f"ipc://{d}/scheduler", f"ipc://{d}/detokenizer", f"ipc://{d}/tokenizer")
