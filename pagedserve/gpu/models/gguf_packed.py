"""GGUF tensors straight into packed low-bit weights, one tensor at a time, no full-precision model.

Q8_0 blocks are the q8_0 layout and Q4_1 blocks the q4_1 layout (kernels/qgemm.py) once the
per-block scales are split from the codes: loading them is a strided copy of the file's bytes.
Q4_0 becomes q4_1 with minimum -8 d (exact: times 8 is exact in fp16). Q4_K is repacked into q4_1
(its 6-bit sub-block scales times the fp16 super-block scale, stored as fp16: 2^-11 relative).
Every other quantized type (Q5_*, Q6_K, Q2_K, Q3_K, ...) and any tensor whose layout differs from
the one asked for is dequantized alone to fp32 and quantized to the target layout.

``plan_layouts`` decides each module's layout from ``--quantization`` and the file's tensor types
before any weight is read (a fused qkv or gate/up module takes all its parts in one layout);
``load`` then copies each packed part into this rank's shard through the module's own
``weight_loader`` (cutting rows or groups of columns, as for a full-precision tensor) and attaches
the packed weights at the end (gpu/models/quantization.py).
"""
from __future__ import annotations

import logging
import mmap
from collections import defaultdict

import numpy as np
import torch

from pagedserve.contracts.errors import ModelLoadError

logger = logging.getLogger(__name__)

_BLOCK = 32


def native_layout(qtype) -> str | None:
    """The packed layout that keeps a GGUF tensor type's precision: None for float types."""
    from gguf.constants import GGMLQuantizationType as T

    if qtype in (T.F32, T.F16, T.BF16, T.F64):
        return None
    name = qtype.name
    if name.startswith(("Q4", "Q3", "Q2", "IQ4", "IQ3", "IQ2", "IQ1", "TQ")):
        return "q4_1"
    return "q8_0"


def _split_blocks(data: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    raw = np.ascontiguousarray(data).reshape(rows, -1)
    if raw.shape[1] % block_bytes:
        raise ValueError(f"a row of {raw.shape[1]} bytes is not a whole number of {block_bytes}-byte blocks")
    return raw.reshape(rows, raw.shape[1] // block_bytes, block_bytes)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, :, at:at + 2]).view(np.float16)[..., 0]


def _direct(data: np.ndarray, qtype, rows: int) -> tuple[np.ndarray, ...] | None:
    """The file's bytes as a packed layout's arrays, when the type maps without arithmetic."""
    from gguf.constants import GGMLQuantizationType as T

    if qtype == T.Q8_0:
        b = _split_blocks(data, rows, 34)
        return np.ascontiguousarray(b[:, :, 2:]).view(np.int8).reshape(rows, -1), _f16(b, 0)
    if qtype == T.Q4_1:
        b = _split_blocks(data, rows, 20)
        return np.ascontiguousarray(b[:, :, 4:]).reshape(rows, -1), _f16(b, 0), _f16(b, 2)
    if qtype == T.Q4_0:
        b = _split_blocks(data, rows, 18)
        d = _f16(b, 0)
        return np.ascontiguousarray(b[:, :, 2:]).reshape(rows, -1), d, (d.astype(np.float32) * -8).astype(np.float16)
    if qtype == T.Q4_K:
        return _q4_k_to_q4_1(data, rows)
    return None


def _q4_k_to_q4_1(data: np.ndarray, rows: int) -> tuple[np.ndarray, ...]:
    """Q4_K super-blocks (256 values: fp16 d and dmin, 8 sub-blocks of 32 with 6-bit scale and
    minimum, 128 bytes of nibbles) as q4_1 groups: W = d*sc * q - dmin*m per sub-block of 32."""
    b = _split_blocks(data, rows, 144)
    n = b.shape[0] * b.shape[1]
    b = b.reshape(n, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    s = b[:, 4:16].astype(np.uint8)
    # 6-bit scales/mins of the 8 sub-blocks (ggml's get_scale_min_k4)
    sc = np.empty((n, 8), np.uint8)
    mn = np.empty((n, 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    qs = b[:, 16:].reshape(n, 4, 32)  # 4 chunks of 64 values: low nibbles = sub-block 2j, high = 2j+1
    codes = np.empty((n, 8, 32), np.uint8)
    codes[:, 0::2] = qs & 0x0F
    codes[:, 1::2] = qs >> 4
    packed = codes[:, :, :16] | (codes[:, :, 16:] << 4)  # q4_1 order: value j low, value j+16 high
    gd = (d * sc).astype(np.float16)
    gm = (-(dmin * mn)).astype(np.float16)
    return packed.reshape(rows, -1), gd.reshape(rows, -1), gm.reshape(rows, -1)


def packed_parts(data: np.ndarray, qtype, shape: tuple[int, int], layout: str,
                 unpermute=None) -> tuple[torch.Tensor, ...]:
    """One GGUF tensor (``data`` as the reader gives it, ``shape`` = (rows, cols)) in ``layout``;
    ``unpermute`` reorders rows (llama.cpp's q/k permutation) on whichever arrays come out."""
    from pagedserve.gpu.models.gguf_quants import dequantize
    from pagedserve.kernels import qgemm

    rows, cols = shape
    parts = _direct(data, qtype, rows) if native_layout(qtype) == layout else None
    if parts is not None:
        if unpermute is not None:
            parts = tuple(unpermute(p) for p in parts)
        return tuple(torch.from_numpy(np.ascontiguousarray(p)) for p in parts)
    w = np.asarray(dequantize(data, qtype), dtype=np.float32).reshape(rows, cols)
    if unpermute is not None:
        w = unpermute(w)
    return qgemm.quantize(torch.from_numpy(np.ascontiguousarray(w)), layout)


# ------------------------------------------------------------------ planning

def _targets(model, reader):
    """{module name: (module, [gguf tensor types of its weight], parts with a splitter?)} for the
    linear layers and embedding tables the file's tensors feed."""
    from pagedserve.gpu.models.gguf_loader import file_arch, gguf_to_hf_name
    from pagedserve.gpu.models.layers import VocabParallelEmbedding
    from pagedserve.gpu.models.quantization import quantizable_types

    kinds = (*quantizable_types(), VocabParallelEmbedding)
    modules = dict(model.named_modules())
    found: dict[str, tuple] = {}
    arch = file_arch(reader)
    for t in reader.tensors:
        hf_name = gguf_to_hf_name(t.name, arch)
        mapped = model.map_weight_name(hf_name) if hf_name is not None else None
        for param_name, _shard, part in mapped or ():
            module_name, attr = param_name.rpartition(".")[::2]
            module = modules.get(module_name)
            if attr != "weight" or not isinstance(module, kinds):
                continue
            entry = found.setdefault(module_name, (module, [], [False]))
            entry[1].append(t.tensor_type)
            entry[2][0] |= part is not None and not getattr(part, "row_cut", False)  # optional: row cuts only
    return found


def plan_layouts(model, reader, mode: str) -> dict[str, str]:
    """{module name: packed layout} for the modules to load packed under ``--quantization mode``
    (auto: as the file says; int8 / int4: those layouts). Modules absent load in full precision."""
    from pagedserve.gpu.models.layers import ParallelLMHead, VocabParallelEmbedding
    from pagedserve.gpu.models.quantization import layout_for

    if mode in (None, "none"):
        return {}
    tied = getattr(model, "tie_word_embeddings", False)  # optional: declared by models that can tie them
    plan = {}
    for name, (module, types, has_part) in _targets(model, reader).items():
        if has_part[0]:
            continue  # a fused checkpoint tensor split by a function other than a row cut: full precision
        natives = [native_layout(t) for t in types]
        k = module.weight.shape[1]
        table = isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)
        head = isinstance(module, ParallelLMHead) or (table and tied)  # a tied table is the head
        if mode == "auto" or (table and not tied):  # as the file says (a lookup table is no matmul)
            if all(n is None for n in natives):
                continue
            layout = "q8_0" if "q8_0" in natives else "q4_1"
        else:
            layout = layout_for(mode, k, head=head)
        if layout == "int8c" or k % _BLOCK:
            continue  # per-channel int8 is computed after loading (quantize_model)
        plan[name] = layout
    return plan


# ------------------------------------------------------------------ loading

def load(model, reader, path: str, hf_config: dict, tracker, plan: dict[str, str],
         take=None, progress=None) -> dict[str, int]:
    """Load every tensor of ``reader``: the planned modules' weights packed, the rest through
    ``tracker`` in full precision; ``take(t)`` is asked first and loads the tensors it answers
    True for itself (a mixture of experts' expert tensors: gpu/models/gguf_experts.py). Returns
    {layout: modules packed}. ``progress``: a gpu.models.load_progress.LoadProgress, told each
    tensor's file bytes."""
    from pagedserve.gpu.models.gguf_loader import iter_gguf_weights
    from pagedserve.gpu.models.quantization import QuantizedWeight, attach, quantizable_types
    from pagedserve.gpu.models.weights import _one_cpu_thread

    modules = dict(model.named_modules())
    from pagedserve.gpu.models.gguf_loader import file_arch

    arch = file_arch(reader)
    heads = {"q_proj": hf_config["num_attention_heads"], "k_proj": hf_config["num_key_value_heads"]}
    slots: dict[str, tuple[torch.Tensor, ...]] = {}
    full_names: list[str] = []
    with _one_cpu_thread():  # per-tensor conversions: on a busy box 2 threads ran 5x slower
        for t in reader.tensors:
            if take is not None and take(t):
                _release(reader, t)
            elif _load_one(t, model, modules, plan, slots, full_names, tracker, path, arch, heads):
                _release(reader, t)
            else:
                continue  # read in full precision below
            if progress is not None:
                progress.update(t.n_bytes)
    if full_names:
        wanted = set(full_names)
        tracker.load_all(((n, w) for n, w in iter_gguf_weights(path, hf_config, reader, only=wanted,
                                                                progress=progress)), source=path)
    row = quantizable_types()[1]
    counts: dict[str, int] = defaultdict(int)
    for module_name in list(slots):  # popped: a kernel that re-lays the weight frees the file's copy here
        tensors = slots.pop(module_name)
        module = modules[module_name]
        bias = None if isinstance(module, row) else getattr(module, "bias", None)  # optional: layer kinds differ
        if bias is not None:
            bias = bias.detach().to(torch.float32).contiguous()
        attach(model, module_name, module, QuantizedWeight(plan[module_name], tensors, bias, module.weight.dtype))
        counts[plan[module_name]] += 1
    return dict(counts)


def _release(reader, t) -> None:
    """Drop the file's pages of a tensor once it is copied (they would otherwise count in the
    process's RSS beside the packed copy until the load ends)."""
    # optional: a memory-mapped reader on a Python with mmap.madvise; else the pages stay until the load ends
    buf = getattr(reader, "_buf", None)
    if buf is None or not hasattr(buf, "madvise"):
        return
    page = mmap.PAGESIZE
    start = -(-t.data_offset // page) * page
    end = (t.data_offset + t.n_bytes) // page * page
    if end > start:
        try:
            buf.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass


def _load_one(t, model, modules, plan, slots, full_names, tracker, path, arch, heads) -> bool:
    """Copy tensor ``t`` into its planned modules' packed slots; False (and noted in
    ``full_names``) when it loads in full precision."""
    from gguf.constants import GGMLQuantizationType as T

    from pagedserve.gpu.models.gguf_loader import _PERMUTED_ARCHS, _SKIPPED, gguf_to_hf_name, unpermute_rows

    if t.name in _SKIPPED:
        return True
    hf_name = gguf_to_hf_name(t.name, arch)
    mapped = model.map_weight_name(hf_name) if hf_name is not None else None
    if hf_name is not None and mapped is None:
        return True  # a tensor the model does not hold (e.g. another pipeline stage's layer): skip it
    targets = [(p, s, cut) for p, s, cut in mapped or () if p.rpartition(".")[0] in plan and p.endswith(".weight")]
    if not targets:
        full_names.append(t.name)
        return False
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if len(shape) != 2:
        raise ModelLoadError(f"{path}: tensor {t.name!r} of shape {shape} feeds a linear layer")
    proj = hf_name.rsplit(".", 2)[-2]
    unpermute = None
    if arch in _PERMUTED_ARCHS and proj in heads:
        def unpermute(a, n=heads[proj]):
            return unpermute_rows(a, n)
    by_layout: dict[str, tuple] = {}  # a fused tensor (Phi-3's qkv) feeds several targets: pack it once
    for param_name, shard_id, cut in targets:
        module_name = param_name.rpartition(".")[0]
        module, layout = modules[module_name], plan[module_name]
        if layout not in by_layout:
            try:
                by_layout[layout] = packed_parts(t.data, T(t.tensor_type), shape, layout, unpermute)
            except (NotImplementedError, ValueError) as e:
                raise ModelLoadError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}) -> {layout}: {e}") from None
        # Every layout keeps the weight's rows as its tensors' first dimension: a row cut applies to each.
        parts = by_layout[layout] if cut is None else tuple(cut(p) for p in by_layout[layout])
        if module_name not in slots:
            from pagedserve.kernels import qgemm

            n_local, k_local = module.weight.shape
            slots[module_name] = tuple(torch.empty(s, dtype=p.dtype)
                                       for s, p in zip(qgemm.packed_shapes(layout, n_local, k_local), parts))
        for dst, src in zip(slots[module_name], parts):
            try:
                module.weight_loader(dst, src, shard_id)
            except ModelLoadError as e:
                raise ModelLoadError(f"{path}: tensor {t.name!r} -> {param_name}: {e}") from None
        tracker.loaded[param_name].add(shard_id)
    return True
