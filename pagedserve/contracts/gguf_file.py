"""A GGUF file's metadata and tensor table, parsed in tens of milliseconds.

``gguf.GGUFReader`` builds a numpy memmap view for every part of every value: for a 49k-token
vocabulary plus 49k merges that is about a million small views, 2-4 s per open on a 2-core box,
and a server start opened the file three times (config, tokenizer, worker). This reader walks
the same format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) with ``struct`` over
one memory map, decodes string arrays in one pass, and exposes what our callers use under the
library's names: ``fields[key].contents()`` and ``tensors[i].name / tensor_type / shape / data``
(``data`` as GGUFReader gives it: typed for float/int tensors, raw uint8 rows for quantized ones).
Type codes and block sizes come from the ``gguf`` package. Files this reader does not handle
(big-endian, GGUF v1) are opened with ``gguf.GGUFReader`` instead.

Only the metadata is parsed up front, with ``struct`` alone: the server reads a model's config
before it starts its workers, and importing numpy and gguf there would delay the start. Arrays
are decoded when asked for, and the tensor table (numpy views of the map) is built on first use.
"""
from __future__ import annotations

import mmap
import struct
from typing import Any

from pagedserve.contracts.errors import ModelLoadError

# GGUF value type codes (gguf.GGUFValueType) -> struct code of one scalar.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ModelLoadError):
    """The file is not a well-formed GGUF file; the message names the file and the spot."""


class GGUFField:
    """One metadata value. ``value_type`` is the gguf.GGUFValueType code; for an array
    ``element_type`` is its elements' code and ``length`` their number. Arrays (the vocabulary,
    the merges, token types) are decoded on first use: a worker never reads them."""

    __slots__ = ("name", "value_type", "element_type", "length", "_value", "_array_at")

    def __init__(self, name: str, value_type: int, value: Any = None, element_type: int | None = None,
                 length: int = 1, array_at: tuple["_Cursor", int] | None = None):
        self.name = name
        self.value_type = value_type
        self.element_type = element_type
        self.length = length
        self._value = value
        self._array_at = array_at  # (cursor, offset) of an array not decoded yet

    def contents(self) -> Any:
        """The value as plain Python (str, int, float, bool or a list of them), like
        ``gguf.ReaderField.contents()``."""
        if self._array_at is not None:
            cur, offset = self._array_at
            cur.pos = offset
            if self.element_type == _STRING:
                self._value = cur.strings(self.length)
            else:
                self._value = list(cur.scalars(self.element_type, self.length))
            self._array_at = None
        return list(self._value) if isinstance(self._value, list) else self._value


class GGUFTensor:
    """One tensor, with GGUFReader's attribute names."""

    __slots__ = ("name", "tensor_type", "shape", "n_elements", "n_bytes", "data_offset", "data")

    def __init__(self, name, tensor_type, shape, n_elements, n_bytes, data_offset, data):
        self.name = name
        self.tensor_type = tensor_type  # gguf.GGMLQuantizationType
        self.shape = shape  # numpy uint64 dims, fastest first, as stored
        self.n_elements = n_elements
        self.n_bytes = n_bytes
        self.data_offset = data_offset
        self.data = data  # read-only numpy view of the memory map


class GGUFFile:
    def __init__(self, path: str, version: int, fields: dict[str, GGUFField],
                 infos: list[tuple[str, tuple[int, ...], int, int]], data_start: int, alignment: int, buf):
        self.path = path
        self.version = version
        self.fields = fields
        self.alignment = alignment
        self.tensor_names = [name for name, _, _, _ in infos]
        self._infos = infos
        self._data_start = data_start
        self._buf = buf
        self._tensors: list[GGUFTensor] | None = None

    @property
    def tensors(self) -> list[GGUFTensor]:
        if self._tensors is None:
            self._tensors = _build_tensors(self.path, self._infos, self._data_start, self._buf)
        return self._tensors


class _Cursor:
    def __init__(self, buf, path: str):
        self.buf = buf
        self.pos = 0
        self.path = path

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise GGUFFormatError(f"{self.path}: truncated GGUF file (wanted {n} bytes at offset {self.pos}, "
                                  f"file has {len(self.buf)})")

    def u32(self) -> int:
        self.need(4)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self) -> int:
        self.need(8)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self) -> str:
        n = self.u64()
        self.need(n)
        start = self.pos
        self.pos += n
        try:
            return str(self.buf[start:self.pos], "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{self.path}: a string at offset {start} is not UTF-8: {e}") from None

    def skip_strings(self, count: int) -> None:
        """Step over ``count`` length-prefixed strings without decoding them."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = _U64.unpack_from
        try:
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
        except struct.error:
            pos = end + 1
        if pos > end:
            raise GGUFFormatError(f"{self.path}: truncated string array before offset {min(pos, end)}")
        self.pos = pos

    def strings(self, count: int) -> list[str]:
        """``count`` length-prefixed strings; the hot loop of a vocabulary."""
        buf, pos = self.buf, self.pos
        unpack = _U64.unpack_from
        out = [""] * count
        try:
            for i in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                out[i] = str(buf[pos:pos + n], "utf-8")
                pos += n
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{self.path}: a string near offset {pos} is not UTF-8: {e}") from None
        self.pos = pos
        return out

    def scalars(self, code: int, count: int) -> tuple:
        fmt = _SCALAR.get(code)
        if fmt is None:
            raise GGUFFormatError(f"{self.path}: unknown GGUF value type {code} at offset {self.pos}")
        layout = struct.Struct(f"<{count}{fmt}")
        self.need(layout.size)
        values = layout.unpack_from(self.buf, self.pos)
        self.pos += layout.size
        return values

    def value(self, name: str) -> GGUFField:
        code = self.u32()
        if code == _STRING:
            return GGUFField(name, code, self.string())
        if code != _ARRAY:
            return GGUFField(name, code, self.scalars(code, 1)[0])
        elem = self.u32()
        count = self.u64()
        start = self.pos
        if elem == _STRING:
            self.skip_strings(count)
        elif elem == _ARRAY:
            raise GGUFFormatError(f"{self.path}: {name}: nested arrays are not supported")
        elif elem in _SCALAR:
            size = struct.calcsize(_SCALAR[elem]) * count
            self.need(size)
            self.pos += size
        else:
            raise GGUFFormatError(f"{self.path}: {name}: unknown array element type {elem}")
        return GGUFField(name, code, None, elem, count, (_Cursor(self.buf, self.path), start))


def read_gguf(path: str):
    """Parse ``path``'s metadata and tensor table. Raises GGUFFormatError (a ModelLoadError)
    naming the file on a bad file."""
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read GGUF file: {e}") from None
    cur = _Cursor(buf, path)
    if len(buf) < 24 or buf[:4] != b"GGUF":
        raise GGUFFormatError(f"{path}: not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.u32()
    if version not in (2, 3):  # v1 (32-bit lengths) or a big-endian file: the library reads those
        return _library_reader(path)
    n_tensors, n_kv = cur.u64(), cur.u64()
    # The header as pseudo-fields, as GGUFReader lists them.
    fields: dict[str, GGUFField] = {"GGUF.version": GGUFField("GGUF.version", 4, version),
                                    "GGUF.tensor_count": GGUFField("GGUF.tensor_count", 10, n_tensors),
                                    "GGUF.kv_count": GGUFField("GGUF.kv_count", 10, n_kv)}
    for _ in range(n_kv):
        key = cur.string()
        fields[key] = cur.value(key)
    infos = []
    seen = set()
    for _ in range(n_tensors):
        name = cur.string()
        if name in seen:
            raise GGUFFormatError(f"{path}: tensor {name!r} appears twice")
        seen.add(name)
        n_dims = cur.u32()
        dims = tuple(cur.u64() for _ in range(n_dims))
        raw_type, offset = cur.u32(), cur.u64()
        infos.append((name, dims, raw_type, offset))
    align_field = fields.get("general.alignment")
    alignment = int(align_field.contents()) if align_field is not None else DEFAULT_ALIGNMENT
    if alignment <= 0:
        raise GGUFFormatError(f"{path}: general.alignment {alignment} is not positive")
    data_start = -(-cur.pos // alignment) * alignment
    return GGUFFile(path, version, fields, infos, data_start, alignment, buf)


def _build_tensors(path: str, infos, data_start: int, buf) -> list[GGUFTensor]:
    """numpy views of each tensor's bytes, shaped as GGUFReader shapes them."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

    plain = {T.F32: np.float32, T.F16: np.float16, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16,
             T.I32: np.int32, T.I64: np.int64}
    tensors = []
    for name, dims, raw_type, offset in infos:
        try:
            ggml_type = T(raw_type)
        except ValueError:
            raise GGUFFormatError(f"{path}: tensor {name!r} has unknown type {raw_type}") from None
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_elements = 1
        for d in dims:
            n_elements *= d
        n_bytes = n_elements * type_size // block_size
        data_offset = data_start + offset
        if data_offset + n_bytes > len(buf):
            raise GGUFFormatError(f"{path}: tensor {name!r} runs past the end of the file "
                                  "(truncated download?)")
        raw = np.frombuffer(buf, dtype=np.uint8, count=n_bytes, offset=data_offset)
        np_dims = tuple(reversed(dims))
        if ggml_type in plain:
            data = raw.view(plain[ggml_type]).reshape(np_dims)
        else:  # quantized (and bf16): raw bytes, the fastest dim counted in bytes
            data = raw.reshape(*np_dims[:-1], np_dims[-1] // block_size * type_size)
        tensors.append(GGUFTensor(name, ggml_type, np.array(dims, dtype=np.uint64), n_elements, n_bytes,
                                  data_offset, data))
    return tensors


def _library_reader(path: str):
    """gguf.GGUFReader for the files we do not parse; same attribute names for our callers."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/struct.error/... on bad files
        raise ModelLoadError(f"{path}: cannot read GGUF file: {e}") from None


def array_length(field) -> int | None:
    """Element count of an array field (ours or the library's), None for a scalar or string."""
    if isinstance(field, GGUFField):
        return field.length if field.value_type == _ARRAY else None
    if field.types and int(field.types[0]) == _ARRAY:
        return len(field.data)
    return None


def tensor_names(reader) -> list[str]:
    """Tensor names of a parsed file (ours: without building the tensor table)."""
    names = getattr(reader, "tensor_names", None)
    return list(names) if names is not None else [t.name for t in reader.tensors]
