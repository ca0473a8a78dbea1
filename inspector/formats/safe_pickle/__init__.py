"""The only place that unpickles anything (see :mod:`.unpickler`).

:mod:`.policy` decides what each global a pickle names becomes, :mod:`.records` holds the
inert stand-ins and tensor descriptions decoding yields, :mod:`.prescan` checks the sizes
a pickle claims before it is run, :mod:`.legacy` reads pre-1.6 torch.save files.
"""

from inspector.formats.safe_pickle.legacy import load_legacy_torch
from inspector.formats.safe_pickle.policy import LEGACY_STORAGE_DTYPES
from inspector.formats.safe_pickle.records import (
    BrokenTensor,
    DtypeName,
    NumpyArray,
    Opaque,
    StorageRef,
    SubclassRef,
    TensorRef,
    UnknownDtype,
)
from inspector.formats.safe_pickle.unpickler import (
    load_data_pickle,
    load_metadata,
    load_plain,
    referenced_globals,
)

__all__ = [
    "LEGACY_STORAGE_DTYPES",
    "BrokenTensor",
    "DtypeName",
    "NumpyArray",
    "Opaque",
    "StorageRef",
    "SubclassRef",
    "TensorRef",
    "UnknownDtype",
    "load_data_pickle",
    "load_legacy_torch",
    "load_metadata",
    "load_plain",
    "referenced_globals",
]
