"""A state as one flat buffer of tensor bytes and a small metadata record, and back.

The state's structure (dicts, lists, numbers, strings: whatever pickles) is pickled with every
tensor replaced by its index (`persistent_id`), so no tensor data is pickled; each tensor's bytes go
at a 64-byte aligned offset of the buffer, its dtype, shape and offset into the record. A tensor
that appears twice is stored once. Tensors come back on the CPU (or `map_location`) as views of
the one buffer read from the file, like `torch.load(..., map_location="cpu")` gives them.
"""

from __future__ import annotations

import io
import os
import pickle
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ddplaunch.hostside.ckpt.layout import FORMAT, TornCheckpoint

ALIGN = 64


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor's bytes are in the buffer and what they are."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    parameter: bool = False
    requires_grad: bool = False


@dataclass
class Packed:
    """A state taken apart: its pickled structure, its tensors and where each goes in the buffer."""

    tree: bytes
    specs: list[TensorSpec]
    tensors: list[torch.Tensor]
    nbytes: int

    def meta(self, step: int, part: int, parts: int) -> bytes:
        """The metadata record written beside the buffer (pickled: small, no tensor data)."""
        return pickle.dumps({"format": FORMAT, "step": step, "part": part, "parts": parts, "nbytes": self.nbytes,
                             "specs": [vars(s) for s in self.specs], "tree": self.tree}, protocol=5)


class _Pickler(pickle.Pickler):
    def __init__(self, out: io.BytesIO) -> None:
        super().__init__(out, protocol=5)
        self.index: dict[int, int] = {}
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> Optional[int]:
        if not isinstance(obj, torch.Tensor):
            return None
        if id(obj) not in self.index:
            if obj.is_sparse or obj.layout != torch.strided:
                raise TypeError(f"checkpoint: a {obj.layout} tensor cannot be saved in the memory tier")
            self.index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return self.index[id(obj)]


def pack(state: Any) -> Packed:
    """Takes `state` apart; its tensors are referenced, not copied."""
    out = io.BytesIO()
    pickler = _Pickler(out)
    pickler.dump(state)
    specs, offset = [], 0
    for t in pickler.tensors:
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes,
                                isinstance(t, torch.nn.Parameter), t.requires_grad))
        offset += -(-nbytes // ALIGN) * ALIGN
    return Packed(out.getvalue(), specs, pickler.tensors, offset)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as flat uint8 (a view when it is contiguous)."""
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def write_at(fd: int, packed: Packed) -> None:
    """Writes every tensor's bytes at its offset of the file `fd` (the kernel copies them: no page
    faults on a fresh mapping, the GIL released); a tensor off the CPU is copied to it first."""
    for spec, t in zip(packed.specs, packed.tensors):
        if not spec.nbytes:
            continue
        view = memoryview(_bytes_of(t).cpu().numpy().data).cast("B")
        at = spec.offset
        while view:
            done = os.pwrite(fd, view, at)
            view, at = view[done:], at + done


def write_to(fd_write: Any, packed: Packed) -> None:
    """Writes the buffer's bytes in order through `fd_write(bytes-like)`, padding included."""
    at = 0
    for spec, t in zip(packed.specs, packed.tensors):
        if spec.offset > at:
            fd_write(bytes(spec.offset - at))
        if spec.nbytes:
            fd_write(_bytes_of(t).cpu().numpy().data)
        at = spec.offset + spec.nbytes
    if packed.nbytes > at:
        fd_write(bytes(packed.nbytes - at))


class _Unpickler(pickle.Unpickler):
    def __init__(self, raw: bytes, tensors: list[torch.Tensor]) -> None:
        super().__init__(io.BytesIO(raw))
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self.tensors[pid]


def step_of(meta: bytes) -> int:
    return int(pickle.loads(meta)["step"])


def unpack(meta: bytes, data: bytearray, map_location: Any = None) -> Any:
    """The state a metadata record and its buffer hold; tensors are views of `data` (on the CPU) or
    copies on `map_location`."""
    try:
        record = pickle.loads(meta)
        if record["format"] != FORMAT or record["nbytes"] != len(data):
            raise TornCheckpoint("the metadata does not describe this buffer")
        tensors = [_tensor(TensorSpec(**fields), data, map_location) for fields in record["specs"]]
        return _Unpickler(record["tree"], tensors).load()
    except (pickle.UnpicklingError, KeyError, TypeError, ValueError, AttributeError, EOFError) as exc:
        raise TornCheckpoint(f"unreadable metadata: {exc}") from exc


def _tensor(spec: TensorSpec, data: bytearray, map_location: Any) -> torch.Tensor:
    dtype = getattr(torch, spec.dtype)
    if spec.nbytes == 0:
        t = torch.empty(spec.shape, dtype=dtype)
    else:
        raw = torch.frombuffer(data, dtype=torch.uint8, count=spec.nbytes, offset=spec.offset)
        t = (raw.view(dtype) if dtype != torch.uint8 else raw).reshape(spec.shape)
    if map_location is not None:
        t = t.to(map_location)
    if spec.parameter:
        return torch.nn.Parameter(t, requires_grad=spec.requires_grad)
    return t.requires_grad_(spec.requires_grad) if spec.requires_grad else t
