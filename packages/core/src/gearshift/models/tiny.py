"""Small causal LMs and a byte-level tokenizer, built locally and saved like any Hugging Face model.

Nothing is downloaded: a preset gives the shape, the weights are random (seeded),
and the folder loads through `AutoModelForCausalLM` / `AutoTokenizer` exactly
as a user's model would, in every engine.

    path = build_model("/tmp/tiny", preset="tiny", arch="qwen2")

A preset is a size (`tiny`, `small`, ...); `arch` picks one of the decoder
architectures transformers ships (`ARCHS`), each configured to that size with
its own parameter names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny() -> dict:
    """~0.1M parameters: unit tests and the conformance suite."""
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=512, vocab_size=320)


def tiny4h() -> dict:
    """Twice tiny's width, 4 query and 2 key/value heads: tensor and sequence parallelism of 2 cut whole heads
    (heads of 32, hidden_size / heads as vLLM reckons them: its CPU attention takes no smaller)."""
    return dict(tiny(), hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def small() -> dict:
    """~3M parameters: the default RL job on a CPU."""
    return dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=512, vocab_size=320)


def bench100m() -> dict:
    """~110M parameters: switch-latency benchmarks on a CPU."""
    return dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                num_key_value_heads=12, head_dim=64, max_position_embeddings=1024, vocab_size=32000)


def deep() -> dict:
    """Qwen2-0.5B's count of tensors (24 layers, 290 tensors) at the tiny preset's widths: where host work
    per tensor dominates a sync, as it does on a GPU (benchmarks of the sync's host time)."""
    return dict(tiny(), num_hidden_layers=24)


def qwen2_0_5b() -> dict:
    """The shape of Qwen2-0.5B (random weights): GPU runs."""
    return dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, vocab_size=151936)


def qwen2_1_5b() -> dict:
    """The shape of Qwen2-1.5B (random weights): GPU runs."""
    return dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, vocab_size=151936)


def qwen2_7b() -> dict:
    """The shape of Qwen2-7B (random weights): GPU runs."""
    return dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, head_dim=128, max_position_embeddings=4096, vocab_size=152064)


PRESETS = {"tiny": tiny, "tiny4h": tiny4h, "small": small, "deep": deep, "bench100m": bench100m,
           "qwen2-0.5b": qwen2_0_5b, "qwen2-1.5b": qwen2_1_5b, "qwen2-7b": qwen2_7b}
#: presets saved in bfloat16 (engines load them in the dtype they are asked for): half the bytes to write and read
BF16_PRESETS = {"qwen2-1.5b", "qwen2-7b"}


def build_tokenizer(path: str | os.PathLike):
    """A byte-level tokenizer (256 byte tokens + specials, no merges) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>", model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def _without(shape: dict, *keys: str) -> dict:
    return {k: v for k, v in shape.items() if k not in keys}


def _gpt(shape: dict, **extra) -> dict:
    """GPT-2-style names (n_embd, n_layer, ...)."""
    return dict(n_embd=shape["hidden_size"], n_inner=shape["intermediate_size"], n_layer=shape["num_hidden_layers"],
                n_head=shape["num_attention_heads"], n_positions=shape["max_position_embeddings"],
                vocab_size=shape["vocab_size"], **extra)


#: architecture -> (transformers config class, the preset's shape in that config's names)
ARCHS: dict[str, tuple[str, object]] = {
    "qwen2": ("Qwen2Config", lambda s: dict(s, rope_theta=10000.0, rms_norm_eps=1e-6)),
    "llama": ("LlamaConfig", lambda s: dict(s, rms_norm_eps=1e-6)),
    "mistral": ("MistralConfig", lambda s: dict(s, rms_norm_eps=1e-6, sliding_window=None)),
    "qwen3": ("Qwen3Config", lambda s: dict(s, rms_norm_eps=1e-6)),
    "granite": ("GraniteConfig", lambda s: dict(s, rms_norm_eps=1e-6)),
    "cohere": ("CohereConfig", lambda s: dict(s)),
    "gemma": ("GemmaConfig", lambda s: dict(s, rms_norm_eps=1e-6)),
    "gemma2": ("Gemma2Config", lambda s: dict(s, rms_norm_eps=1e-6, query_pre_attn_scalar=s["head_dim"],
                                              sliding_window=256)),
    "gemma3": ("Gemma3TextConfig", lambda s: dict(s, rms_norm_eps=1e-6, query_pre_attn_scalar=s["head_dim"],
                                                  sliding_window=256)),
    # mixtures of experts: transformers holds each layer's experts stacked in one tensor and the folder stores
    # them one by one (see gearshift.stored); Mixtral's `block_sparse_moe` is also renamed `mlp` in memory
    "qwen3_moe": ("Qwen3MoeConfig", lambda s: dict(s, rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=s["intermediate_size"] // 2,
                                                   decoder_sparse_step=1, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", lambda s: dict(s, rms_norm_eps=1e-6, num_local_experts=4, num_experts_per_tok=2)),
    "phi3": ("Phi3Config", lambda s: dict(_without(s, "head_dim"),
                                          original_max_position_embeddings=s["max_position_embeddings"])),
    "phi": ("PhiConfig", lambda s: dict(_without(s, "head_dim"), partial_rotary_factor=0.5)),
    "stablelm": ("StableLmConfig", lambda s: dict(_without(s, "head_dim"), partial_rotary_factor=0.25)),
    "gpt2": ("GPT2Config", lambda s: _gpt(s)),
    # GPT-J checkpoints keep their own output head (with a bias), and vLLM's GPT-J expects one
    "gptj": ("GPTJConfig", lambda s: _gpt(s, rotary_dim=s["head_dim"] // 2, tie_word_embeddings=False)),
    "opt": ("OPTConfig", lambda s: dict(hidden_size=s["hidden_size"], ffn_dim=s["intermediate_size"],
                                        num_hidden_layers=s["num_hidden_layers"],
                                        num_attention_heads=s["num_attention_heads"],
                                        max_position_embeddings=s["max_position_embeddings"],
                                        vocab_size=s["vocab_size"], word_embed_proj_dim=s["hidden_size"])),
    "bloom": ("BloomConfig", lambda s: dict(hidden_size=s["hidden_size"], n_layer=s["num_hidden_layers"],
                                            n_head=s["num_attention_heads"], vocab_size=s["vocab_size"],
                                            max_position_embeddings=s["max_position_embeddings"])),
    "falcon": ("FalconConfig", lambda s: dict(hidden_size=s["hidden_size"], num_hidden_layers=s["num_hidden_layers"],
                                              num_attention_heads=s["num_attention_heads"], num_kv_heads=1,
                                              new_decoder_architecture=False, multi_query=True, parallel_attn=True,
                                              alibi=False, bias=False, vocab_size=s["vocab_size"],
                                              max_position_embeddings=s["max_position_embeddings"])),
}


def _config(arch: str, shape: dict, tokenizer, dtype: str):
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")
    if shape["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size {shape['vocab_size']} is smaller than the tokenizer's {len(tokenizer)}")
    class_name, names = ARCHS[arch]
    options = {"tie_word_embeddings": True, **names(shape)}
    return getattr(transformers, class_name)(
        **options, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype=dtype,
    )


#: shapes of at least this many parameters are drawn on a GPU when there is one
GPU_INIT_PARAMS = 200_000_000


def _parameters(shape: dict) -> int:
    """About how many parameters a decoder of `shape` has (embedding, attention, MLP)."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    kv = shape.get("num_key_value_heads", shape["num_attention_heads"]) * shape.get("head_dim", 64)
    return shape["vocab_size"] * h + layers * (2 * h * h + 2 * h * kv + 3 * h * shape["intermediate_size"])


def build_model(path: str | os.PathLike, preset: str | dict = "tiny", arch: str = "qwen2", seed: int = 0,
                dtype: str = "float32") -> str:
    """Build (once; a folder with the same recipe is reused) and save a model with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    shape = PRESETS[preset]() if isinstance(preset, str) else dict(preset)
    if isinstance(preset, str) and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    path = Path(path)
    # a large shape is drawn on the GPU where there is one (seconds, against minutes for 7B on the CPU); the
    # device is part of the recipe, since the two draw other numbers from one seed
    on_gpu = torch.cuda.is_available() and _parameters(shape) >= GPU_INIT_PARAMS
    recipe = {"shape": shape, "arch": arch, "seed": seed, "dtype": dtype, "v": 1}
    recipe = json.dumps({**recipe, "device": "cuda"} if on_gpu else recipe, sort_keys=True)
    stamp = path / "gearshift-recipe.json"
    if stamp.exists() and stamp.read_text() == recipe:
        return str(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    config = _config(arch, shape, tokenizer, dtype)
    with torch.random.fork_rng(devices=[0] if on_gpu else []), torch.device("cuda" if on_gpu else "cpu"):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(path), safe_serialization=True)
    stamp.write_text(recipe)
    if on_gpu:  # the weights' blocks would stay in this process's torch cache, which no other process can use
        del model
        torch.cuda.empty_cache()
    return str(path)
