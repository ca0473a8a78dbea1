"""DeepSpeed ZeRO checkpoints: step folders read, fp32 master weights rebuilt (no DeepSpeed)."""

from inspector.formats.deepspeed.files import looks_like_deepspeed
from inspector.formats.deepspeed.reader import DeepSpeedSource

__all__ = ["DeepSpeedSource", "looks_like_deepspeed"]
