"""``llama_hf/``: a tiny Llama 3 saved as torchtitan 0.3 saves it, next to the Hugging Face
assets a conversion needs: the demo of ``inspector.export(..., format="hf")``.

``checkpoint/`` holds the weights under torchtitan 0.3 names (flat model keys) beside one
real AdamW step's optimizer state, lr_scheduler and train_state, written by ``dcp.save``;
``assets/`` holds ``config.json`` (LlamaConfig fields), a word-level ``tokenizer.json``
with its ``tokenizer_config.json`` and ``special_tokens_map.json``, and
``generation_config.json``. Plain torch and JSON: building it needs no transformers.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

HF_DEMO = "llama_hf"
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
CORPUS = (  # the tokenizer's words
    "the a of and to in is it that on for with as by this be from at or an "
    "model weights checkpoint train step layer head token tokens attention expert experts "
    "route routes fox dog quick brown lazy jumps over hugging face folder torch titan "
    "load save export shard tensor tensors key keys name names rope query value "
    "small tiny demo"
)
VOCAB = (*SPECIALS, *CORPUS.split())
DIMS = {"vocab_size": len(VOCAB), "dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128}
ROPE_THETA = 500000.0
SEED = 11


def build_llama_hf(out: Path) -> Path:
    """Write ``out/llama_hf/{checkpoint,assets}``; returns ``out/llama_hf``."""
    folder = out / HF_DEMO
    _save_checkpoint(folder / "checkpoint")
    assets = folder / "assets"
    assets.mkdir(parents=True, exist_ok=True)
    for name, body in _assets().items():
        (assets / name).write_text(json.dumps(body, indent=2) + "\n")
    return folder


def model_config() -> Any:
    """The TinyLlama dimensions of the demo (its July-2025 names are the doctor's example)."""
    from inspector.demo.model import TinyLlamaConfig

    return TinyLlamaConfig(**DIMS)


def _save_checkpoint(path: Path) -> None:
    """Seeded TinyLlama weights, one AdamW step, every key respelled in torchtitan 0.3 names."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from inspector.demo.model import build_model
    from inspector.keys.generations import respell

    model = build_model(SEED, model_config())
    with torch.no_grad():
        for p in model.parameters():  # norms too: a swapped weight must change the logits
            p.mul_(1 + 0.1 * torch.randn_like(p))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optim.step()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    optimizer = get_optimizer_state_dict(model, optim, options=flat)
    state = {respell(k, "torchtitan-2025", "torchtitan"): v for k, v in model.state_dict().items()}
    state["optimizer"] = {
        respell(k, "torchtitan-2025", "torchtitan"): v for k, v in optimizer.items()
    }
    state["train_state"] = {"step": torch.tensor(1, dtype=torch.int32)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def _assets() -> dict[str, Any]:
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    specials = dict(
        zip(("unk_token", "bos_token", "eos_token", "pad_token"), SPECIALS, strict=True)
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": DIMS["vocab_size"],
        "hidden_size": DIMS["dim"],
        "intermediate_size": DIMS["hidden_dim"],
        "num_hidden_layers": DIMS["n_layers"],
        "num_attention_heads": DIMS["n_heads"],
        "num_key_value_heads": DIMS["n_heads"],
        "head_dim": DIMS["dim"] // DIMS["n_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": ROPE_THETA,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        **ids,
    }
    return {
        "config.json": config,
        "tokenizer.json": _tokenizer(),
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", **specials},
        "special_tokens_map.json": specials,
        "generation_config.json": {**ids, "do_sample": False},
    }


def _tokenizer() -> dict[str, Any]:
    """A tokenizers-library ``tokenizer.json``: whitespace pre-tokenizer, word-level vocab."""
    added = [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, token in enumerate(SPECIALS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {
            "type": "WordLevel",
            "vocab": {token: i for i, token in enumerate(VOCAB)},
            "unk_token": "<unk>",
        },
    }
