"""`LLM.get_tokenizer()`: the engine's own tokenizer and chat template, behind the calls that
code written for vLLM makes on the tokenizer its `LLM.get_tokenizer()` returns (a transformers
tokenizer): `encode`, `decode`, `batch_decode`, `tokenizer(text)`, `apply_chat_template`, the
named special tokens and the vocabulary (`tokenize`, `convert_tokens_to_ids`,
`convert_ids_to_tokens`, `convert_tokens_to_string`, `get_vocab`, `vocab_size`, `len`), with
transformers' arguments and defaults. Each call goes through the Router (its `/tokenize`,
`/detokenize` and chat render routes, or its vocabulary), so a prompt built here is exactly the
one the engine builds for the same messages: no second tokenizer or template is loaded."""

from __future__ import annotations

import numbers
import warnings
from typing import Any, Callable

import numpy as np
import orjson

from llmserve._core import Router

# transformers' apply_chat_template arguments this tokenizer does not take (each would change
# what comes back, so none is dropped silently); any other keyword goes to the template, as
# there.
_UNSUPPORTED = ("chat_template", "padding", "truncation", "max_length", "return_tensors",
                "return_assistant_tokens_mask", "tokenizer_kwargs")


class Encoding(dict):
    """transformers' `BatchEncoding` as far as `tokenizer(text)` is read: `input_ids` and
    `attention_mask`, as keys or attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    """The engine's tokenizer and chat template (see the module doc). It keeps the engine's
    Router, and with it the tokenizer, after the `LLM` is closed. `encode_body` writes a
    request body as the offline calls write theirs (their checks of what JSON cannot hold)."""

    def __init__(self, router: Router, model_name: str, special_tokens: dict[str, Any],
                 encode_body: Callable[[Router, dict[str, Any]], bytes]) -> None:
        self._router = router
        self._model = model_name
        self._special = {k: v for k, v in special_tokens.items() if isinstance(v, str)}
        self._encode_body = encode_body

    # transformers' named special tokens: the text (None when the tokenizer names none) and,
    # as `*_token_id`, its id
    bos_token = property(lambda self: self._special.get("bos_token"))
    eos_token = property(lambda self: self._special.get("eos_token"))
    pad_token = property(lambda self: self._special.get("pad_token"))
    unk_token = property(lambda self: self._special.get("unk_token"))
    bos_token_id = property(lambda self: self._id_of(self.bos_token))
    eos_token_id = property(lambda self: self._id_of(self.eos_token))
    pad_token_id = property(lambda self: self._id_of(self.pad_token))
    unk_token_id = property(lambda self: self._id_of(self.unk_token))

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        ids = self.encode(token, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids; `add_special_tokens`: with the tokenizer's (BOS) around them, as a
        completion prompt gets them."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str; got {type(text).__name__}")
        return _warned(self._call("tokenize", {"prompt": text, "add_special_tokens": add_special_tokens}))["tokens"]

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> Encoding:
        """`encode` of a text (or of each of a list of texts) as transformers' `tokenizer(text)`
        answers: `input_ids` and an all-ones `attention_mask` (no padding)."""
        if isinstance(text, (list, tuple)):
            each = [self.encode(t, add_special_tokens) for t in text]
            return Encoding(input_ids=each, attention_mask=[[1] * len(ids) for ids in each])
        ids = self.encode(text, add_special_tokens)
        return Encoding(input_ids=ids, attention_mask=[1] * len(ids))

    def decode(self, token_ids: Any, skip_special_tokens: bool = False) -> str | list[str]:
        """The text of `token_ids` (an id, or a list, tuple, 1-D array or tensor of ids), as the
        engine detokenizes output; `skip_special_tokens` leaves out the special tokens' text.
        Several sequences (a list of id lists, a 2-D array) give one text each, as
        transformers 5 decodes them."""
        if not isinstance(token_ids, np.ndarray) and hasattr(token_ids, "numpy"):
            token_ids = token_ids.numpy(force=True)   # (a torch tensor)
        if isinstance(token_ids, np.ndarray) and token_ids.ndim == 0:
            token_ids = token_ids.item()
        if (isinstance(token_ids, np.ndarray) and token_ids.ndim == 2) or (
                isinstance(token_ids, (list, tuple)) and token_ids and isinstance(token_ids[0], (list, tuple))):
            return self.batch_decode(token_ids, skip_special_tokens)
        ids = [int(token_ids)] if integer(token_ids) else _ids(token_ids, "token_ids")
        return self._call("detokenize", {"tokens": ids, "skip_special_tokens": skip_special_tokens})["prompt"]

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False) -> list[str]:
        """`decode` of each sequence (a list of id lists, or a 2-D array)."""
        texts = []
        for i, seq in enumerate(sequences):
            body = {"tokens": _ids(seq, f"sequences[{i}]"), "skip_special_tokens": skip_special_tokens}
            texts.append(self._call("detokenize", body)["prompt"])
        return texts

    def apply_chat_template(self, conversation: list[dict[str, Any]] | list[list[dict[str, Any]]],
                            tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tokenize: bool = True, return_dict: bool = False, **kwargs: Any) -> Any:
        """`conversation` (a list of messages, or a list of such lists) rendered through the
        model's chat template as the chat route renders it: the prompt text, or (`tokenize`,
        the default as in transformers) its token ids, as a list (transformers 4's default),
        or with `return_dict` as an `Encoding` (transformers 5's default). Other keyword
        arguments reach the template (`chat_template_kwargs`); one it never reads is warned
        about, as the offline calls warn about fields without effect."""
        if bad := [name for name in _UNSUPPORTED if name in kwargs]:
            raise TypeError(f"apply_chat_template here does not take {', '.join(bad)} (it renders with the "
                            f"engine's own template and returns a str or a list of token ids)")
        many = isinstance(conversation, (list, tuple)) and bool(conversation) and isinstance(
            conversation[0], (list, tuple))
        body: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                                "continue_final_message": continue_final_message}
        if tools is not None:
            body["tools"] = tools
        if documents is not None:
            body["documents"] = documents
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        out = []
        for messages in conversation if many else [conversation]:
            if tokenize:
                answer = self._call("tokenize", {**body, "messages": list(messages)})
            else:
                answer = self._call("chat_render", {**body, "model": self._model, "messages": list(messages)})
            out.append(_warned(answer)["tokens" if tokenize else "prompt"])
        if tokenize and return_dict:
            masks = [[1] * len(ids) for ids in out]
            return Encoding(input_ids=out if many else out[0], attention_mask=masks if many else masks[0])
        return out if many else out[0]

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary without the tokens added to it, as transformers counts it
        (`len(tokenizer)` counts them too)."""
        return self._router.base_vocab_size

    def __len__(self) -> int:
        return self._router.vocab_size

    def get_vocab(self) -> dict[str, int]:
        """Every raw vocabulary piece ("Ġthe", "<|im_end|>") and its id, added tokens included."""
        return self._router.vocab()

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """The id of a raw vocabulary piece (or of each of a list); a piece not in the
        vocabulary gives `unk_token_id` (None when the tokenizer has no unknown token), as in
        transformers."""
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> str | None | list[str | None]:
        """The raw vocabulary piece of an id (or of each of a list, array or tensor of ids,
        leaving out the special tokens with `skip_special_tokens`); None for an id outside the
        vocabulary, as in transformers."""
        if integer(ids):
            return self._router.id_to_token(int(ids))
        return [self._router.id_to_token(i) for i in _ids(ids, "ids")
                if not (skip_special_tokens and self._router.is_special(i))]

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        """`text`'s raw vocabulary pieces ("Ġworld"), without the special tokens a prompt gets
        around it unless `add_special_tokens`, as transformers' `tokenize`."""
        piece = self._router.id_to_token
        return [piece(i) or "" for i in self.encode(text, add_special_tokens)]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """The text of raw vocabulary pieces (`tokenize`'s), as the engine detokenizes their
        ids; ValueError for a piece not in the vocabulary."""
        ids = [self._router.token_to_id(t) for t in tokens]
        if unknown := [t for t, i in zip(tokens, ids) if i is None]:
            raise ValueError(f"not pieces of this vocabulary: {unknown}")
        return self._call("detokenize", {"tokens": ids, "skip_special_tokens": False})["prompt"]

    def _token_id(self, token: str) -> int | None:
        if not isinstance(token, str):
            raise TypeError(f"convert_tokens_to_ids takes a str or a list of them; got {type(token).__name__}")
        found = self._router.token_to_id(token)
        return self.unk_token_id if found is None else found

    def _call(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        data, _ = self._router.handle(endpoint, self._encode_body(self._router, body))
        return orjson.loads(data)


def _warned(answer: dict[str, Any]) -> dict[str, Any]:
    """`answer`, after warning the caller of the public method about its fields without
    effect (a template kwarg the template never reads)."""
    if ignored := answer.get("ignored_fields"):
        warnings.warn(f"llmserve: these arguments had no effect: {', '.join(ignored)}", stacklevel=3)
    return answer


def integer(t: object) -> bool:
    """An integer, numpy's too, not a bool."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def token_ids(p: object) -> list[int] | None:
    """`p` as token ids (Python ints) when it is a list, tuple or 1-D array of integers (numpy's
    too, not bools), else None."""
    if isinstance(p, np.ndarray):
        return p.tolist() if p.ndim == 1 and p.dtype.kind in "iu" else None
    if isinstance(p, (list, tuple)) and all(map(integer, p)):
        return [int(t) for t in p]
    return None


def _ids(seq: Any, name: str) -> list[int]:
    """`seq` (token ids, or a torch tensor of them) as a list of Python ints; TypeError naming
    `name` otherwise."""
    if not isinstance(seq, np.ndarray) and hasattr(seq, "numpy"):
        seq = seq.numpy(force=True)
    if (ids := token_ids(seq)) is None:
        raise TypeError(f"{name} must be token ids: a list, tuple or 1-D array of integers; got {type(seq).__name__}")
    return ids
