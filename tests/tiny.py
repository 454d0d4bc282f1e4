"""Tiny random models the tests build themselves: a Hugging Face folder with a trained
byte-level BPE tokenizer, a ChatML template and random Llama weights. Seeded, so every run
builds the same model."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1000",
    "Café, naïve, résumé, 東京, 😀 emoji and more text about models and tokens.",
    "user assistant system tool stop the end",
]


def build_tokenizer(path: Path, vocab_size: int = 384) -> int:
    """Train a byte-level BPE tokenizer.json at `path`; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.save(str(path))
    return tok.get_vocab_size()


def random_llama_weights(c: dict, draw, top: dict) -> dict:
    """HF-named weights of the Llama-shaped config `c` (an HF config.json dict): `top` (the
    embeddings, final norm and any lm_head, drawn by the caller in its own way) then every
    layer's tensors from `draw(*shape)`, norm weights as 1 + draw."""
    h, i = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    w = dict(top)
    for layer in range(c["num_hidden_layers"]):
        p, a = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn."
        w.update({a + "q_proj.weight": draw(nh * d, h), a + "k_proj.weight": draw(nkv * d, h),
                  a + "v_proj.weight": draw(nkv * d, h), a + "o_proj.weight": draw(h, nh * d),
                  p + "mlp.gate_proj.weight": draw(i, h), p + "mlp.up_proj.weight": draw(i, h),
                  p + "mlp.down_proj.weight": draw(h, i), p + "input_layernorm.weight": 1 + draw(h),
                  p + "post_attention_layernorm.weight": 1 + draw(h)})
    return w


def build_tiny_llama(folder: Path, *, max_position_embeddings: int = 512, seed: int = 0,
                     **shape) -> Path:
    """A complete HF model folder: config, safetensors, tokenizer, template, generation config.
    `shape`: LlamaConfig fields that replace the tiny defaults (hidden 64 over 4 heads, ...)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(folder / "tokenizer.json")
    eos = SPECIALS.index("<|im_end|>")
    config = LlamaConfig(**{
        **dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=eos, rope_theta=10000.0),
        **shape})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHATML,
    }))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder


def write_gguf_shape(w, cfg, rope_theta: float) -> None:
    """The model-shape keys of a GGUF file (a gguf.GGUFWriter `w`), from the transformers
    config `cfg`, as llama.cpp's converter writes them for every decoder."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)


# The shape the parity tests give every family (each adds its own keys).
PARITY_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5)


def random_hf_model(config_name: str, arch: str, **config):
    """transformers' `arch` built from `config_name(**config)` with every weight drawn anew
    (norm scales near 1, the rest small, so no layer is near the identity), in eval mode, and
    its config dict."""
    import torch
    import transformers

    cfg = getattr(transformers, config_name)(**config)
    cfg.architectures = [arch]
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name or ".ln_" in name else 0.1 * noise)
    return hf, cfg.to_dict()


def hf_logits(hf, tokens: list[int]):
    """transformers' logits of every position of one sequence, float32 [len(tokens), V]."""
    import torch

    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def write_gguf_vocab(w, specials: list[str], vocab_size: int, pre: str) -> None:
    """A GGUF file's byte-level BPE vocabulary (a gguf.GGUFWriter `w`): `specials` (control
    tokens), then `w`, `0`, `1` and `w<i>` up to `vocab_size`, merged by "w 0" and "w 1" (the
    merges' parts are tokens too, so a server can build this vocabulary's tokenizer); BOS 1,
    EOS 2; `pre`: llama.cpp's pre-tokenizer name."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(specials + ["w", "0", "1"] + [f"w{i}" for i in range(vocab_size - len(specials) - 3)])
    w.add_token_types([3] * len(specials) + [1] * (vocab_size - len(specials)))
    w.add_token_merges(["w 0", "w 1"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def lora_shapes(c: dict) -> dict[str, tuple[int, int]]:
    """[out, in] of each PEFT LoRA target of a decoder layer of the HF config `c`."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    d = c.get("head_dim") or h // heads
    q, kv, i = heads * d, (c.get("num_key_value_heads") or heads) * d, c["intermediate_size"]
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "qkv_proj": (q + 2 * kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "gate_up_proj": (2 * i, h), "down_proj": (h, i)}


def write_peft_adapter(folder: Path, c: dict, targets: list[str], *, r: int = 4, alpha: float = 8.0,
                       seed: int = 0, infix: str = "", config: dict | None = None) -> dict:
    """A PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) for the HF config `c`:
    random lora_A [r, in] and lora_B [out, r] (B non-zero, unlike PEFT's init) for each of
    `targets` (module names: q_proj, ...) in every layer, keyed as PEFT saves them (`infix`:
    ".default" as some PEFT versions write). `config`: keys that replace the defaults of
    adapter_config.json. Returns {"model.layers.0.self_attn.q_proj": (A, B)} (unscaled)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = lora_shapes(c)
    pairs, tensors = {}, {}
    for layer in range(c["num_hidden_layers"]):
        for t in targets:
            module = f"model.layers.{layer}.{'mlp' if 'gate' in t or 'up_' in t or 'down' in t else 'self_attn'}.{t}"
            out, inp = shapes[t]
            a, b = 0.3 * torch.randn(r, inp, generator=g), 0.3 * torch.randn(out, r, generator=g)
            pairs[module] = (a, b)
            tensors[f"base_model.model.{module}.lora_A{infix}.weight"] = a
            tensors[f"base_model.model.{module}.lora_B{infix}.weight"] = b
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
           "target_modules": list(targets), "bias": "none", "use_rslora": False, "use_dora": False,
           "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
           "layers_to_transform": None, "base_model_name_or_path": "tiny", **(config or {})}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return pairs
