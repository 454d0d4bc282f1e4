"""Hugging Face model folders: config.json, safetensors weights, tokenizer and template files.

Reads, never guesses: the chat template sources are handed over raw (the router resolves
them in CONTRACT.md's order), generation_config.json is passed whole, and the EOS ids are the
union of generation_config.json's and config.json's (generation_config first, as transformers'
generate uses it). No network here; hub ids are downloaded by `load.py` first.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import Checkpoint, LoadError, empty_template_sources


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LoadError(f"cannot read {path}: {e}") from e


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _weight_files(folder: Path) -> list[Path]:
    index = _read_json(folder / "model.safetensors.index.json")
    if index is not None:
        shards = sorted(set(index.get("weight_map", {}).values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if not shards or missing:
            raise LoadError(f"{folder}: model.safetensors.index.json names missing shards {missing or '(none)'}")
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    hint = " (pytorch_model.bin is not supported: convert it to safetensors)" if any(folder.glob("*.bin")) else ""
    raise LoadError(f"no weights in {folder}: expected model.safetensors or model.safetensors.index.json{hint}")


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        try:
            weights.update(load_file(str(path)))
        except Exception as e:  # safetensors raises its own SafetensorError on corrupt files
            raise LoadError(f"cannot read weights {path}: {e}") from e
    return weights


def _vocab_id(tokenizer_json: Path, token: str) -> int | None:
    """The id of `token` in tokenizer.json (added tokens first, then the model vocabulary)."""
    data = _read_json(tokenizer_json) or {}
    for added in data.get("added_tokens", []):
        if added.get("content") == token:
            return int(added["id"])
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and token in vocab:
        return int(vocab[token])
    return None


# sentence-transformers' pooling modes (1_Pooling/config.json) -> ours.
_ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


def sentence_transformers(folder: Path) -> dict:
    """How a sentence-transformers folder makes embeddings (Checkpoint.sentence_transformers):
    the pooling mode of its Pooling module, whether a Normalize module follows, and why it
    cannot be served as its files say (a mode other than last-token or mean, a module after
    the transformer other than Pooling and Normalize, such as Dense). Empty when the folder
    has no modules.json."""
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list):
        return {}
    out: dict = {"pooling": "last", "normalize": False}
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            out["normalize"] = True
        elif kind == "Pooling":
            config = _read_json(folder / str(module.get("path", "")) / "config.json") or {}
            modes = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
            if len(modes) != 1 or modes[0] not in _ST_POOLING:
                out["unsupported"] = f"its pooling ({', '.join(modes) or 'none'}) is not last-token or mean"
            else:
                out["pooling"] = _ST_POOLING[modes[0]]
        else:
            out["unsupported"] = f"its {kind or 'unnamed'} module is not supported"
    return out


@dataclass(frozen=True)
class TokenizerFiles:
    """What a folder says about its tokenizer: its tokenizer.json, its chat templates (the
    folder's slots of the template sources) and its special tokens."""

    tokenizer_json: Path
    templates: dict
    # every special token a template sees by name, bos_token and eos_token too (_special_tokens)
    special_tokens: dict[str, str]

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def eos_token_id(self) -> int | None:
        """The EOS token's id in tokenizer.json (read when asked: the file can be megabytes)."""
        return None if self.eos_token is None else _vocab_id(self.tokenizer_json, self.eos_token)


def read_tokenizer(folder: Path) -> TokenizerFiles:
    """The tokenizer files of a model folder (or of a tokenizer's own folder, `--tokenizer`)."""
    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise LoadError(
            f"{folder} has no tokenizer.json (slow-only tokenizers such as tokenizer.model are not "
            "supported: save the tokenizer with a fast tokenizer to get tokenizer.json)"
        )
    tok_config = _read_json(folder / "tokenizer_config.json") or {}
    templates = read_templates(folder, tok_config)
    # Older checkpoints name their special tokens in special_tokens_map.json only;
    # transformers reads both (tokenizer_config.json first).
    special = _special_tokens(tok_config, _read_json(folder / "special_tokens_map.json") or {})
    return TokenizerFiles(tokenizer_json, templates, special)


def read_templates(folder: Path, tok_config: dict | None = None) -> dict:
    """The chat templates a model folder's files hold (TemplateSources; no "gguf" or "cli"):
    `chat_template.jinja`, `additional_chat_templates/`, and `tokenizer_config.json`'s (or
    `chat_template.json`'s) `chat_template`. Also read for a folder that holds a GGUF file,
    whose templates come before the file's own."""
    if tok_config is None:
        tok_config = _read_json(folder / "tokenizer_config.json") or {}
    templates = empty_template_sources()
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        templates["folder_jinja"] = jinja.read_text(encoding="utf-8")
    # transformers saves the templates other than "default" here, one file per name
    for named in sorted((folder / "additional_chat_templates").glob("*.jinja")):
        templates["folder_named"][named.stem] = named.read_text(encoding="utf-8")
    if tok_config.get("chat_template") is not None:
        templates["tokenizer_config"] = tok_config["chat_template"]
    else:
        # Processor-style repos keep it in chat_template.json; it fills the same slot.
        legacy = _read_json(folder / "chat_template.json") or {}
        if legacy.get("chat_template") is not None:
            templates["tokenizer_config"] = legacy["chat_template"]
            templates["tokenizer_config_file"] = "chat_template.json"
    return templates


def _special_tokens(tok_config: dict, special_map: dict) -> dict[str, str]:
    """The special tokens transformers' apply_chat_template passes to a template by name: the
    named ones, and a model's own (an `extra_special_tokens` dict, or any other `*_token` key
    holding a token, as Gemma 3's `image_token`). As transformers reads them: a
    tokenizer_config.json with `added_tokens_decoder` (a newer save) says them all; an older
    one's special_tokens_map.json is read too, and wins where both name a token."""
    found: dict[str, str] = {}
    sources = (tok_config,) if "added_tokens_decoder" in tok_config else (tok_config, special_map)
    for source in sources:
        extra = source.get("extra_special_tokens")
        named = {**source, **(extra if isinstance(extra, dict) else {})}
        for key, value in named.items():
            if key.endswith("_token") and (text := _token_text(value)) is not None:
                found[key] = text
    return found


def tokenizer_tokens(tokenizer_json: Path) -> list[str | None]:
    """Each id's token in a tokenizer.json (its model's vocabulary and its added tokens; None
    for an id neither names)."""
    data = _read_json(tokenizer_json) or {}
    by_id: dict[int, str] = {}
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):     # BPE, WordPiece, WordLevel
        by_id.update((int(i), tok) for tok, i in vocab.items())
    elif isinstance(vocab, list):   # Unigram: [piece, score] in id order
        by_id.update((i, entry[0]) for i, entry in enumerate(vocab))
    for added in data.get("added_tokens", []):
        by_id[int(added["id"])] = added.get("content")
    return [by_id.get(i) for i in range(max(by_id, default=-1) + 1)]


def load_folder(folder: Path, name: str, log: logging.Logger) -> Checkpoint:
    t0 = time.perf_counter()
    config = _read_json(folder / "config.json")
    if config is None:
        raise LoadError(f"{folder} is not a model folder: it has no config.json (nor a .gguf file)")
    # (imported here: the model families import the loaders)
    from llmserve.models import supported_architectures

    arch = (config.get("architectures") or [None])[0]
    supported = supported_architectures()
    if arch not in supported:
        raise LoadError(
            f"architecture {arch!r} ({folder / 'config.json'}) is not supported; "
            f"supported: {', '.join(supported)}"
        )
    # NOTE: transformers >= 5 writes rope_theta inside rope_parameters; keep the flat key too so
    # every reader of hf_config finds it in one place.
    rope = config.get("rope_parameters")
    if "rope_theta" not in config and isinstance(rope, dict) and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]

    tok = read_tokenizer(folder)
    generation_config = _read_json(folder / "generation_config.json") or {}
    eos_ids: list[int] = []
    for i in _ids(generation_config.get("eos_token_id")) + _ids(config.get("eos_token_id")):
        if i not in eos_ids:
            eos_ids.append(i)
    if not eos_ids and (found := tok.eos_token_id()) is not None:
        eos_ids = [found]
    t1 = time.perf_counter()

    weights = _load_weights(folder)
    log.info(
        "model folder %s: %s, %d tensors read in %.2f s (metadata %.2f s)",
        folder, arch, len(weights), time.perf_counter() - t1, t1 - t0,
    )
    return Checkpoint(
        name=name,
        hf_config=config,
        weights=weights,
        tokenizer_json=str(tok.tokenizer_json),
        gguf_vocab=None,
        template_sources=tok.templates,
        special_tokens=tok.special_tokens,
        eos_token_ids=eos_ids,
        generation_config=generation_config,
        sentence_transformers=sentence_transformers(folder),
    )
