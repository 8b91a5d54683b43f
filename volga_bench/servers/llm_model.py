"""The LLM server's model (`llm_app`): a Llama-architecture decoder of 1.17B parameters with seeded random weights,
written once into a folder as transformers reads it (`config.json`, `model.safetensors`)."""

from __future__ import annotations

import pathlib

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

WEIGHTS = "model.safetensors"


def config_1b(kv_heads: int = 16) -> LlamaConfig:
    """A Llama-architecture decoder of 1.17B parameters (TinyLlama's shape with 16 KV heads: its KV cache takes 88 KiB
    per token in fp16)."""
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                       num_attention_heads=32, num_key_value_heads=kv_heads, max_position_embeddings=65536,
                       tie_word_embeddings=False)


def make_model(folder: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write the 1B model with seeded random weights (fp16) into `folder` (kept when already there)."""
    folder = pathlib.Path(folder)
    if (folder / WEIGHTS).exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config_1b()).half()
    config_1b().save_pretrained(folder)
    save_file({k: v.contiguous().cpu() for k, v in model.state_dict().items()}, str(folder / (WEIGHTS + ".tmp")))
    (folder / (WEIGHTS + ".tmp")).rename(folder / WEIGHTS)
    return folder
