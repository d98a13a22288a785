"""A Hugging Face model id as a local model path, downloaded through huggingface_hub as
``vllm serve org/name`` and llama.cpp's ``-hf org/name:Q4_K_M`` do.

Forms: ``org/name`` (a safetensors repo: config, tokenizer and weights files only; or a GGUF-only
repo: its one GGUF file, else its Q4_K_M as llama.cpp picks), ``org/name:Q4_K_M`` (a GGUF repo's
file of that quant tag, any case), ``org/name:file.gguf`` or ``org/name/file.gguf`` (that file).

huggingface_hub does the work: the cache layout (``$HF_HUB_CACHE``, or ``--download-dir``),
``--revision``, ``HF_TOKEN``, progress bars, retries that resume a broken transfer with a Range
request. ``HF_HUB_OFFLINE=1`` (or no reachable Hub) serves the snapshot the cache holds. Each failure
a user can cause (no such repo, a gated repo without a token, no usable weights, offline and not
cached) is one ConfigError line that says what to change. The environment is read at each call,
not when huggingface_hub was imported, so ``HF_ENDPOINT`` / ``HF_HUB_OFFLINE`` set later count.
"""
from __future__ import annotations

import logging
import os
import re

from pagedserve.contracts.config import ConfigError

logger = logging.getLogger(__name__)

_REPO = r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
_MODEL_REF = re.compile(rf"^(?P<repo>{_REPO})(?::(?P<tag>[A-Za-z0-9._-]+)|/(?P<file>[^/]+\.gguf))?$")
# What a safetensors repo needs: config, generation defaults, tokenizer, weights (+ their index).
HF_DIR_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "*.safetensors", "model.safetensors.index.json"]
DEFAULT_GGUF_TAG = "Q4_K_M"  # llama.cpp's -hf default when a repo holds several quantizations
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def hub_cache_dir() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def parse_model_ref(name: str) -> tuple[str, str | None, str | None] | None:
    """(repo id, quant tag or None, GGUF file name or None) of a Hub reference, None when ``name``
    is not one (a local path that exists is never a Hub reference)."""
    if os.path.exists(name):
        return None
    m = _MODEL_REF.match(name)
    if m is None:
        return None
    tag, file = m["tag"], m["file"]
    if tag is not None and tag.lower().endswith(".gguf"):
        tag, file = None, tag
    return m["repo"], tag, file


def looks_like_model_id(name: str) -> bool:
    return parse_model_ref(name) is not None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", os.environ.get("TRANSFORMERS_OFFLINE", "")).strip().upper() in {
        "1", "ON", "YES", "TRUE"}


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def choose_gguf(files: list[str], repo: str, tag: str | None, file: str | None) -> str:
    """The GGUF file of ``files`` a reference names (llama.cpp's -hf rules: the file whose name
    holds the tag, any case; without a tag the only file, else the Q4_K_M one)."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and not _is_extra_split(f))
    if file is not None:
        found = [f for f in ggufs if f == file or os.path.basename(f) == file]
        if not found:
            raise ConfigError(f"model {repo!r} has no file {file!r} (its GGUF files: {_names(ggufs)})")
        return found[0]
    if not ggufs:
        raise ConfigError(f"model {repo!r} has no usable weights: no config.json with *.safetensors "
                          f"and no .gguf file")
    if tag is None:
        if len(ggufs) == 1:
            return ggufs[0]
        tag = DEFAULT_GGUF_TAG
        missing = (f"model {repo!r} holds several GGUF files and none is {DEFAULT_GGUF_TAG}: "
                   f"name one as {repo}:TAG or {repo}:FILE (tags: {_tags(ggufs)})")
    else:
        missing = f"model {repo!r} has no GGUF file of quant tag {tag!r} (tags: {_tags(ggufs)})"
    pattern = re.compile(rf"(^|[-._/]){re.escape(tag)}([-.]|$)", re.IGNORECASE)  # Q4_K is not Q4_K_M
    found = [f for f in ggufs if pattern.search(os.path.basename(f)[:-len(".gguf")] + ".")]
    if not found:
        raise ConfigError(missing)
    return found[0]


def _is_extra_split(name: str) -> bool:
    m = _SPLIT.search(name)
    return m is not None and m[1] != "00001"


def _names(files: list[str]) -> str:
    return ", ".join(files) or "none"


def _tags(ggufs: list[str]) -> str:
    out = []
    for f in ggufs:
        stem = _SPLIT.sub(".gguf", os.path.basename(f))[:-len(".gguf")]
        m = re.search(r"(?:^|[-._])((?:I?Q\d[A-Z0-9_]*)|F16|BF16|F32)$", stem, re.IGNORECASE)
        out.append(m[1] if m else os.path.basename(f))
    return ", ".join(out) or "none"


def _is_hf_dir(files: list[str]) -> bool:
    return "config.json" in files and any(f.endswith(".safetensors") for f in files)


def _local_snapshot(repo: str, revision: str, cache_dir: str) -> str | None:
    """The cached snapshot directory of ``repo`` at ``revision`` (a branch, tag or commit)."""
    storage = os.path.join(cache_dir, "models--" + repo.replace("/", "--"))
    commit = revision
    ref = os.path.join(storage, "refs", revision)
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
    path = os.path.join(storage, "snapshots", commit)
    return path if os.path.isdir(path) else None


def _list_local(path: str) -> list[str]:
    out = []
    for root, _, names in os.walk(path):
        out += [os.path.relpath(os.path.join(root, n), path).replace(os.sep, "/") for n in names]
    return out


def resolve_model_ref(name: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The local path (a directory, or a GGUF file) of the Hub reference ``name``, downloaded
    into ``download_dir`` (else the HF cache) unless it is there; ConfigError when it cannot be."""
    ref = parse_model_ref(name)
    if ref is None:
        raise ConfigError(f"{name!r} is neither a local path nor a Hugging Face model id (org/name, "
                          f"org/name:QUANT, org/name/file.gguf)")
    repo, tag, file = ref
    revision = revision or "main"
    cache_dir = download_dir or hub_cache_dir()
    if _offline():
        return _from_cache(repo, tag, file, revision, cache_dir, why="HF_HUB_OFFLINE is set")
    try:
        return _download(repo, tag, file, revision, cache_dir)
    except _Unreachable as e:
        return _from_cache(repo, tag, file, revision, cache_dir, why=f"the Hub ({_endpoint()}) cannot be reached: {e}")


class _Unreachable(Exception):
    pass


def _is_connection_error(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectError", "TimeoutException", "NetworkError", "ConnectionError"})


def _from_cache(repo: str, tag: str | None, file: str | None, revision: str, cache_dir: str, why: str) -> str:
    snapshot = _local_snapshot(repo, revision, cache_dir)
    if snapshot is None:
        raise ConfigError(f"model {repo!r} (revision {revision}) is not in the local cache ({cache_dir}) and "
                          f"{why}: download it once online, or pass a local path")
    files = _list_local(snapshot)
    if tag is None and file is None and _is_hf_dir(files):
        return snapshot
    return os.path.join(snapshot, choose_gguf(files, repo, tag, file))


def _download(repo: str, tag: str | None, file: str | None, revision: str, cache_dir: str) -> str:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    endpoint = _endpoint()
    try:
        try:
            # model info (one request, not retried: an unreachable Hub fails at once) lists the files
            info = HfApi(endpoint=endpoint).model_info(repo, revision=revision)
            files = [s.rfilename for s in info.siblings or []]
        except Exception as e:  # noqa: BLE001 - the HTTP client (httpx or httpx2) varies by version
            if not (isinstance(e, LocalEntryNotFoundError) or _is_connection_error(e)):
                raise
            raise _Unreachable(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
        if tag is None and file is None and _is_hf_dir(files):
            logger.info("downloading %s (revision %s) into %s", repo, revision, cache_dir)
            return snapshot_download(repo, revision=revision, cache_dir=cache_dir, endpoint=endpoint,
                                     allow_patterns=HF_DIR_PATTERNS)
        chosen = choose_gguf(files, repo, tag, file)
        m = _SPLIT.search(chosen)
        if m is not None:
            raise ConfigError(f"{repo}/{chosen} is split into {int(m[2])} files; pagedserve reads one GGUF file: "
                              f"merge them with llama.cpp's `llama-gguf-split --merge`")
        logger.info("downloading %s/%s (revision %s) into %s", repo, chosen, revision, cache_dir)
        return hf_hub_download(repo, chosen, revision=revision, cache_dir=cache_dir, endpoint=endpoint)
    except GatedRepoError:
        raise ConfigError(f"model {repo!r} is gated: accept its terms on the Hub and set HF_TOKEN to a token "
                          f"of an account that may read it") from None
    except RevisionNotFoundError:
        raise ConfigError(f"model {repo!r} has no revision {revision!r} (a branch, tag or commit)") from None
    except RepositoryNotFoundError:
        hint = "" if os.environ.get("HF_TOKEN") else "; a private repo needs HF_TOKEN"
        raise ConfigError(f"model {repo!r} was not found on the Hub ({endpoint}): check the name{hint}") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        if status == 401:
            raise ConfigError(f"model {repo!r}: the Hub refused access (401): set HF_TOKEN to a token that "
                              f"may read it") from None
        raise ConfigError(f"model {repo!r}: the Hub answered HTTP {status}: "
                          f"{str(e).splitlines()[0]}") from None
