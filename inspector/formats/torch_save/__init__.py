"""torch.save files: the safe lazy reader (:mod:`.reader`) and the streaming writer
(:mod:`.writer`, which needs torch's own zip writer)."""

from inspector.formats.torch_save.reader import TorchSaveSource

__all__ = ["TorchSaveSource"]
