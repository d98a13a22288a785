"""A GGUF file's expert tensors kept packed: ``blk.N.ffn_{gate,up,down}_exps`` hold one projection
of all experts (3D: experts, rows, row bytes); each expert's slice goes to the layer's
SparseMoeBlock (gpu/models/moe.py) in the packed layout that keeps its precision (q8_0, or q4_1
for 4-bit and lower types: gguf_packed.packed_parts), or the ``--quantization int8|int4`` one.
Float expert tensors under ``auto`` or ``none`` load in full precision through the weight tracker.
Why: a 30B-A3B file dequantized to fp32 would take ~120 GB; packed it stays the file's size."""
from __future__ import annotations

import re

from pagedserve.contracts.errors import ModelLoadError

_EXPERTS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_PART = {"gate": 0, "up": 1, "down": 2}


def expert_layout(qtype, mode: str | None, cols: int) -> str | None:
    """The packed layout of an expert tensor of ``qtype`` under ``--quantization mode``, or None
    for full precision."""
    from pagedserve.gpu.models.gguf_packed import native_layout
    from pagedserve.gpu.models.quantization import layout_for

    if mode in (None, "none"):
        return None
    layout = native_layout(qtype) if mode == "auto" else layout_for(mode, cols)
    return None if layout == "int8c" else layout


def has_expert_tensors(reader) -> bool:
    return any(_EXPERTS_RE.match(t.name) for t in reader.tensors)


def load_expert_tensor(t, model, mode: str | None, tracker, path: str) -> bool:
    """Load GGUF tensor ``t`` packed into its layer's experts when it is an expert tensor that
    stays packed; False when it is not one (or loads in full precision)."""
    from gguf.constants import GGMLQuantizationType as T

    from pagedserve.gpu.models.gguf_packed import packed_parts
    from pagedserve.gpu.models.moe import SparseMoeBlock

    m = _EXPERTS_RE.match(t.name)
    if m is None:
        return False
    layer, part = int(m.group(1)), _PART[m.group(2)]
    if not model.stage.owns_layer(layer):
        return True  # another pipeline stage's layer
    moe = model.model.layers[layer].mlp
    if not isinstance(moe, SparseMoeBlock):
        raise ModelLoadError(f"{path}: tensor {t.name!r}: layer {layer} is not a mixture-of-experts layer")
    block = moe.experts
    experts, rows, cols = (int(d) for d in reversed(t.shape.tolist()))
    if experts != block.num_experts:
        raise ModelLoadError(f"{path}: tensor {t.name!r} holds {experts} experts; the config says "
                             f"{block.num_experts}")
    qtype = T(t.tensor_type)
    layout = expert_layout(qtype, mode, cols)
    if layout is None:
        return False
    param = f"model.layers.{layer}.mlp.experts.{'w2' if part == 2 else 'w13'}"
    for e in range(experts):
        try:
            parts = packed_parts(t.data[e], qtype, (rows, cols), layout)
        except (NotImplementedError, ValueError) as err:
            raise ModelLoadError(f"{path}: tensor {t.name!r} ({qtype.name}) expert {e} -> {layout}: {err}") from None
        block.load_packed_part(e, part, layout, parts)
        tracker.loaded[param].add(e if part == 2 else (e, part))
    return True


def finish(model) -> None:
    """After every tensor: each expert layer packed throughout (its dense stacks freed) or not at all."""
    from pagedserve.gpu.models.moe import FusedExperts

    for module in model.modules():
        if isinstance(module, FusedExperts):
            module.finish_packed()
