"""A DCP metadata pickle read without running code (standard library and torch only): the
unpickler resolves only the globals torch's FileSystemWriter puts in a `.metadata` (DCP's metadata
classes, torch.Size, dtypes, layouts, a path) and refuses every other before looking it up; the
result must be a DCP `Metadata` whose files are plain names inside its checkpoint's directory.
Rank 0 reads the ranks' own metadata with it before merging them (dcpfiles.publish). A copy of
jobs/fsdp_train.py's reader, which the job keeps for itself (it runs without ddplaunch)."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddplaunch.hostside.ckpt.layout import TornCheckpoint

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

#: Every global a DCP `.metadata` pickle may name (torch 2.x FileSystemWriter); torch's dtypes
#: (torch.float32...) are allowed beside them. A torch that pickles metadata differently fails closed.
ALLOWED_GLOBALS = frozenset({("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath")})


class _Unpickler(pickle.Unpickler):
    """pickle.Unpickler resolving only ALLOWED_GLOBALS and torch's dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            import torch

            if isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names the global {module}.{name}, which DCP metadata never holds")


def loads_metadata(raw: bytes, where: Path) -> Metadata:
    """The DCP Metadata pickled in `raw` (read from `where`, named in errors), checked.

    Raises:
        TornCheckpoint: it is not DCP metadata, names a global DCP metadata never holds, or points
            at a file that is not a plain name inside its directory.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _Unpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # whatever these bytes do wrong: refused, nothing of them used
        reason = str(exc) if isinstance(exc, pickle.UnpicklingError) else f"{type(exc).__name__}: {exc}"
        raise TornCheckpoint(f"refusing {where}: {(reason.splitlines() or ['?'])[0][:200]}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise TornCheckpoint(f"refusing {where}: not DCP metadata")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name \
                or getattr(info, "transform_descriptors", None):
            raise TornCheckpoint(f"refusing {where}: it points at {name!r}, not a plain file of its directory")
    return metadata
