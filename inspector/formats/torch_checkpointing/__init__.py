"""torch_checkpointing ("DCPv2") folders: see :mod:`.reader`."""

from inspector.formats.torch_checkpointing.folder import looks_like_torch_checkpointing
from inspector.formats.torch_checkpointing.reader import PerRank, TorchCheckpointingSource

__all__ = ["PerRank", "TorchCheckpointingSource", "looks_like_torch_checkpointing"]
