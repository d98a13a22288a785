"""An adapter's files are read as what they claim to be (issue 37, findings 4 and 5): the
safetensors header's ``data_offsets`` must lie in the file and match each tensor's shape and dtype
(a truncated or doctored file is refused at load, not inside a worker's step); adapter_config.json
is read only up to a size cap and only as a regular file (a FIFO or /dev/zero never hangs the load);
with ``follow_symlinks=False`` (runtime loads under --lora-root) neither file may be a symlink."""
from __future__ import annotations

import json
import os
import struct

import pytest

from pagedserve.contracts.lora import CONFIG_MAX_BYTES, LoRAAdapterError, read_adapter
from tests.lora_fixtures import TINY_HF, write_adapter_files

WEIGHTS = "adapter_model.safetensors"


def _rewrite_header(path, edit) -> None:
    """Change the safetensors header of ``path``/WEIGHTS with ``edit(table)``, data kept."""
    f = path / WEIGHTS
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    table = json.loads(raw[8:8 + n])
    edit(table)
    head = json.dumps(table).encode()
    head += b" " * (-len(head) % 8)
    f.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])


def _first_key(table) -> str:
    return next(k for k in table if k != "__metadata__")


def test_a_truncated_weights_file_is_refused_at_load(tmp_path):
    path = write_adapter_files(tmp_path / "a")
    read_adapter(str(path), TINY_HF, 4)
    f = path / WEIGHTS
    f.write_bytes(f.read_bytes()[:-5])
    with pytest.raises(LoRAAdapterError, match="past the end of the file"):
        read_adapter(str(path), TINY_HF, 4)


@pytest.mark.parametrize("edit, words", [
    (lambda t, k: t[k].update(data_offsets=[0, 10 ** 12]), "past the end of the file"),
    (lambda t, k: t[k].update(data_offsets=[8, 4]), "data_offsets"),
    (lambda t, k: t[k].update(data_offsets=[-4, 4]), "data_offsets"),
    (lambda t, k: t[k].update(data_offsets="0-4"), "data_offsets"),
    (lambda t, k: t[k].update(data_offsets=[0, 4]), "bytes for its shape"),
    (lambda t, k: t[k].update(shape=[2, -8]), "shape"),
])
def test_offsets_and_sizes_are_checked_against_the_shape_and_the_file(tmp_path, edit, words):
    path = write_adapter_files(tmp_path / "a")
    _rewrite_header(path, lambda t: edit(t, _first_key(t)))
    with pytest.raises(LoRAAdapterError, match=words):
        read_adapter(str(path), TINY_HF, 4)


def test_a_header_longer_than_the_file_is_refused(tmp_path):
    path = write_adapter_files(tmp_path / "a")
    f = path / WEIGHTS
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    with pytest.raises(LoRAAdapterError, match="not a safetensors file"):
        read_adapter(str(path), TINY_HF, 4)


def test_the_config_is_read_only_up_to_its_cap_and_only_as_a_regular_file(tmp_path):
    path = write_adapter_files(tmp_path / "a")
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["padding"] = "x" * CONFIG_MAX_BYTES
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoRAAdapterError, match="larger than"):
        read_adapter(str(path), TINY_HF, 4)
    (path / "adapter_config.json").unlink()
    os.mkfifo(path / "adapter_config.json")  # opening a FIFO for reading would wait for a writer
    with pytest.raises(LoRAAdapterError, match="not a regular file"):
        read_adapter(str(path), TINY_HF, 4)


def test_symlinked_files_are_refused_when_not_followed(tmp_path):
    good = write_adapter_files(tmp_path / "good")
    linked = tmp_path / "linked"
    linked.mkdir()
    for name in ("adapter_config.json", WEIGHTS):
        (linked / name).symlink_to(good / name)
    assert read_adapter(str(linked), TINY_HF, 4).rank == 2  # --lora-modules (the operator's): followed
    with pytest.raises(LoRAAdapterError, match="symbolic link"):
        read_adapter(str(linked), TINY_HF, 4, follow_symlinks=False)
    (linked / "adapter_config.json").unlink()
    (linked / "adapter_config.json").write_bytes((good / "adapter_config.json").read_bytes())
    with pytest.raises(LoRAAdapterError, match="symbolic link"):
        read_adapter(str(linked), TINY_HF, 4, follow_symlinks=False)
    assert read_adapter(str(good), TINY_HF, 4, follow_symlinks=False).rank == 2
