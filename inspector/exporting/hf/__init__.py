"""Architecture adapters for Hugging Face export: torchtitan <-> HF names and transforms,
planned one source tensor per output so an exporter can stream.

``plan = to_hf(metas, hf_config)``; for each ``o in plan.outputs``:
``write(o.name, o.transform(read(o.source)))``; write ``plan.config`` as config.json.
Adding an architecture: a module declaring ``ARCH`` plus one line in ``registry``.
"""

from inspector.exporting.hf.apply import apply_plan
from inspector.exporting.hf.base import (
    NAMINGS,
    Architecture,
    Output,
    Plan,
    Rule,
    TensorMeta,
    tensor_meta,
)
from inspector.exporting.hf.registry import (
    ARCHITECTURES,
    Detection,
    auto_reason,
    detect,
    from_hf,
    get,
    to_hf,
)

__all__ = [
    "ARCHITECTURES",
    "NAMINGS",
    "Architecture",
    "Detection",
    "Output",
    "Plan",
    "Rule",
    "TensorMeta",
    "apply_plan",
    "auto_reason",
    "detect",
    "from_hf",
    "get",
    "tensor_meta",
    "to_hf",
]
