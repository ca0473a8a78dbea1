"""DeepSpeed ZeRO checkpoints: step folders read, fp32 master weights rebuilt (no DeepSpeed)."""

from inspector.formats.deepspeed.files import TAG_FILE, looks_like_deepspeed
from inspector.formats.deepspeed.reader import DeepSpeedSource

__all__ = ["TAG_FILE", "DeepSpeedSource", "looks_like_deepspeed"]
