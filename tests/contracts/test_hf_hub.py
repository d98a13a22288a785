"""`serve org/name` downloads through the real huggingface_hub client, here from a fake Hub on
127.0.0.1 (tests/contracts/fake_hub.py; HF_ENDPOINT points at it): only the files a model needs,
--revision, --download-dir, HF_TOKEN for a gated repo, HF_HUB_OFFLINE=1 from the cache, GGUF repos
by quant tag (llama.cpp's ``-hf org/name:Q4_K_M``) or file name, one clear error line for a missing
repo / a gated one without a token / a repo without weights, and a broken transfer resumed."""
from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
from safetensors.numpy import save

from pagedserve.app.cli import build_parser
from pagedserve.app.engine_args import engine_config_from_args
from pagedserve.contracts.config import ConfigError, EngineConfig
from pagedserve.contracts.hf_hub import choose_gguf, parse_model_ref
from pagedserve.engine.bootstrap import resolve_config
from pagedserve.loadtest.tiny_model import TINY_CONFIG
from tests.contracts.fake_hub import FakeHub, start


def tiny_gguf_bytes(tmp_path, name: str, hidden: int = 64) -> bytes:
    """A GGUF file of the tiny Llama's shape (metadata and one tensor are all a config read needs)."""
    path = tmp_path / name
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_token_list(["a", "b", "c"])
    w.add_tokenizer_model("gpt2")
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def hf_repo_files(hidden: int = 64) -> dict[str, bytes]:
    cfg = dict(TINY_CONFIG, hidden_size=hidden)
    weights = save({"model.norm.weight": np.ones(hidden, dtype=np.float32),
                    "model.embed_tokens.weight": np.arange(4096, dtype=np.float32).reshape(64, 64)})
    return {"config.json": json.dumps(cfg).encode(), "generation_config.json": b'{"temperature": 0.5}',
            "tokenizer.json": b"{\"t\": 1}", "tokenizer_config.json": b"{}", "model.safetensors": weights,
            "pytorch_model.bin": b"x" * 1000, "README.md": b"# tiny", "original/consolidated.00.pth": b"y" * 100}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fake Hub, the real client pointed at it, an empty cache; tests/conftest.py's HF_HUB_OFFLINE=1
    (read by huggingface_hub at import) lifted for the test."""
    from huggingface_hub import constants

    fake = FakeHub()
    server, _ = start(fake)
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no token file of the machine's
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    yield fake
    server.shutdown()
    server.server_close()


def resolve(model: str, **options):
    return resolve_config(EngineConfig.from_options(model=model, load_format="dummy", **options))


def test_a_repo_is_downloaded_with_only_the_files_a_model_needs(hub, tmp_path):
    files = hf_repo_files()
    hub.add("org/tiny", files)
    config, hf = resolve("org/tiny")
    path = config.model.model
    assert path.startswith(str(tmp_path / "cache" / "models--org--tiny" / "snapshots"))
    assert config.model.served_model_name == "org/tiny" and hf["hidden_size"] == 64
    assert sorted(hub.downloads()) == ["config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer.json", "tokenizer_config.json"]
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        assert f.read() == files["model.safetensors"]
    # served again: from the cache, nothing fetched twice
    before = len(hub.downloads())
    assert resolve("org/tiny")[0].model.model == path
    assert len(hub.downloads()) == before


def test_revision_and_download_dir(hub, tmp_path):
    hub.add("org/tiny", hf_repo_files(64))
    commit = hub.add("org/tiny", hf_repo_files(32), revision="v2")
    target = tmp_path / "models"
    config, hf = resolve("org/tiny", revision="v2", download_dir=str(target))
    assert hf["hidden_size"] == 32
    assert config.model.model == str(target / "models--org--tiny" / "snapshots" / commit)
    assert not (tmp_path / "cache").exists()
    assert resolve("org/tiny", revision=commit)[1]["hidden_size"] == 32  # a commit id too
    assert resolve("org/tiny")[1]["hidden_size"] == 64
    with pytest.raises(ConfigError, match="has no revision 'v9'"):
        resolve("org/tiny", revision="v9")


def test_the_cli_takes_revision_and_download_dir():
    argv = ["serve", "org/tiny", "--revision", "v2", "--download-dir", "/d"]
    args = build_parser(argv).parse_args(argv)
    config = engine_config_from_args(args)
    assert (config.model.revision, config.model.download_dir) == ("v2", "/d")


def test_offline_serves_the_cache_and_never_calls_the_hub(hub, monkeypatch):
    hub.add("org/tiny", hf_repo_files())
    path = resolve("org/tiny")[0].model.model
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.log.clear()
    assert resolve("org/tiny")[0].model.model == path
    assert hub.log == []
    with pytest.raises(ConfigError, match=r"'org/other' \(revision main\) is not in the local cache .*HF_HUB_OFFLINE"):
        resolve("org/other")
    assert hub.log == []


def test_an_unreachable_hub_falls_back_to_the_cache(hub, monkeypatch):
    hub.add("org/tiny", hf_repo_files())
    path = resolve("org/tiny")[0].model.model
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: connection refused
    assert resolve("org/tiny")[0].model.model == path
    with pytest.raises(ConfigError, match="cannot be reached"):
        resolve("org/other")


def test_a_gguf_repo_by_quant_tag_or_file_name(hub, tmp_path):
    q4 = tiny_gguf_bytes(tmp_path, "a.gguf", hidden=64)
    q8 = tiny_gguf_bytes(tmp_path, "b.gguf", hidden=32)
    hub.add("org/tiny-GGUF", {"tiny-Q4_K_M.gguf": q4, "tiny-Q8_0.gguf": q8, "README.md": b"#"})
    config, hf = resolve("org/tiny-GGUF:Q8_0")
    assert config.model.model.endswith("tiny-Q8_0.gguf") and hf["hidden_size"] == 32
    assert config.model.served_model_name == "org/tiny-GGUF:Q8_0"
    assert hub.downloads() == ["tiny-Q8_0.gguf"]
    assert resolve("org/tiny-GGUF:q4_k_m")[0].model.model.endswith("tiny-Q4_K_M.gguf")  # any case
    assert resolve("org/tiny-GGUF")[0].model.model.endswith("tiny-Q4_K_M.gguf")  # llama.cpp's default
    assert resolve("org/tiny-GGUF/tiny-Q8_0.gguf")[0].model.model.endswith("tiny-Q8_0.gguf")
    assert resolve("org/tiny-GGUF:tiny-Q8_0.gguf")[0].model.model.endswith("tiny-Q8_0.gguf")
    assert sorted(set(hub.downloads())) == ["tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf"]
    with pytest.raises(ConfigError, match=r"no GGUF file of quant tag 'Q6_K' \(tags: Q4_K_M, Q8_0\)"):
        resolve("org/tiny-GGUF:Q6_K")


def test_a_one_file_gguf_repo_needs_no_tag(hub, tmp_path):
    hub.add("org/one-GGUF", {"model.gguf": tiny_gguf_bytes(tmp_path, "m.gguf")})
    assert resolve("org/one-GGUF")[0].model.model.endswith("model.gguf")


def test_choose_gguf_rules():
    files = ["x-Q4_K_M.gguf", "x-Q4_K_S.gguf", "x-Q4_0.gguf", "x-f16.gguf", "big-Q8_0-00001-of-00002.gguf",
             "big-Q8_0-00002-of-00002.gguf"]
    assert choose_gguf(files, "o/x", "Q4_0", None) == "x-Q4_0.gguf"
    assert choose_gguf(files, "o/x", "F16", None) == "x-f16.gguf"
    assert choose_gguf(files, "o/x", "Q8_0", None) == "big-Q8_0-00001-of-00002.gguf"
    with pytest.raises(ConfigError, match="no GGUF file of quant tag 'Q4_K'"):
        choose_gguf(files, "o/x", "Q4_K", None)  # a tag names a whole quant type, not a prefix of one
    assert parse_model_ref("org/name:Q4_K_M") == ("org/name", "Q4_K_M", None)
    assert parse_model_ref("org/name/f.gguf") == ("org/name", None, "f.gguf")
    assert parse_model_ref("org/name") == ("org/name", None, None)
    assert parse_model_ref("not a model") is None


def test_a_split_gguf_is_refused_by_name(hub, tmp_path):
    data = tiny_gguf_bytes(tmp_path, "s.gguf")
    hub.add("org/split", {"m-Q8_0-00001-of-00002.gguf": data, "m-Q8_0-00002-of-00002.gguf": data})
    with pytest.raises(ConfigError, match="split into 2 files.*llama-gguf-split --merge"):
        resolve("org/split:Q8_0")


def test_a_gated_repo_needs_a_token(hub, monkeypatch):
    hub.add("org/gated", hf_repo_files(), gated_token="hf_secret")
    with pytest.raises(ConfigError, match="'org/gated' is gated: .*set HF_TOKEN") as e:
        resolve("org/gated")
    assert "\n" not in str(e.value)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert resolve("org/gated")[1]["hidden_size"] == 64
    assert all(h.get("authorization") == "Bearer hf_secret" for _, _, h in hub.log[-3:])


def test_a_missing_repo_and_a_repo_without_weights(hub):
    with pytest.raises(ConfigError, match=r"model 'org/nope' was not found on the Hub \(http://127.0.0.1") as e:
        resolve("org/nope")
    assert "\n" not in str(e.value)
    hub.add("org/empty", {"README.md": b"#", "config.json": json.dumps(TINY_CONFIG).encode()})
    with pytest.raises(ConfigError, match="'org/empty' has no usable weights"):
        resolve("org/empty")
    assert hub.downloads() == []


def test_a_broken_transfer_is_resumed_with_a_range_request(hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1024)  # bytes reach the file before the cut
    files = hf_repo_files()
    half = 8 * 1024  # a whole number of chunks: what the client wrote before the cut
    hub.add("org/tiny", files)
    hub.cut_after["model.safetensors"] = half
    path = resolve("org/tiny")[0].model.model
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        assert f.read() == files["model.safetensors"]
    gets = [h for m, p, h in hub.log if m == "GET" and p.endswith("/model.safetensors")]
    assert len(gets) == 2 and "range" not in gets[0]
    assert gets[1]["range"] == f"bytes={half}-"


def test_a_local_path_is_never_a_hub_id(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config(EngineConfig.from_options(model="/no/such/file.gguf"))
    assert parse_model_ref(str(tmp_path)) is None



def test_a_gguf_downloaded_by_tag_generates_as_the_local_file(hub, tmp_path):
    """The whole chain: `LLM("org/name:Q8_0")` downloads the file, loads it and generates the same
    greedy tokens as the same file given by path."""
    from gguf.constants import GGMLQuantizationType as T

    from pagedserve.engine.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams
    from tests.gpu.test_model_families_gguf import GGUF_FAMILIES
    from tests.gpu.test_models import save_hf_model
    from tests.gpu.tiny_gguf import write_gguf

    arch, cfg = GGUF_FAMILIES["gemma2"]
    ref = save_hf_model(cfg, tmp_path / "hf")
    local = tmp_path / "tiny-Q8_0.gguf"
    write_gguf(ref, arch, local, T.Q8_0)
    hub.add("org/tiny-GGUF", {"tiny-Q8_0.gguf": local.read_bytes(), "README.md": b"#"})
    params = SamplingParams(temperature=0, max_tokens=8)
    prompt = {"prompt_token_ids": [5, 17, 3, 42, 8]}
    outputs = []
    for model in ("org/tiny-GGUF:Q8_0", str(local)):
        llm = LLM(model=model, kv_cache_memory=0.05)
        outputs.append(list(llm.generate([prompt], params)[0].outputs[0].token_ids))
        del llm
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8
    assert hub.downloads() == ["tiny-Q8_0.gguf"]
