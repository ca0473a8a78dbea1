"""Megatron-Core torch_dist -> HF folder of ~1.1 GB: time and peak memory against a plain copy.

The source is a 3-layer, 2048-wide GQA Llama (fp32, untied 32000-row vocabulary) written
as a torch_dist folder by ``inspector.export(hf, out, format="megatron")`` (stacked layers,
one DCP chunk per layer, fused QKV and SwiGLU fc1, the common state's ``args``); with
``--moe`` a 1.5 GB Qwen3-MoE of the same width (qk-norm, 8 experts of width 1408 per layer,
stacked [layers, experts, ...] as Megatron saves them), each HF expert cut from its layer's
slice of the stacked experts. Each row
runs in a fresh process after ``sync``: the bare ``import inspector``, then per round a
plain copy of the folder (``shutil.copytree`` + fsync) and right after it the default
``format="hf"`` export (verified), which splits QKV / fc1 one layer slice at a time. At
TP=1 every HF tensor is a byte range of stored chunks (a layer, an expert, a QKV part's
rows per query group), so the export copies bytes and never imports torch; the benchmark
checks that it did not. The package's modules are byte-compiled first into a temporary
``PYTHONPYCACHEPREFIX`` (as an installed package is; with ``PYTHONDONTWRITEBYTECODE`` set,
every run would otherwise compile the export's modules again, ~0.2-0.4 s of work the copy
never pays). Each round's copy / export seconds are printed in order.
Goals (median over rounds; ranges printed):
- work <= 1.5 x copy;
- the export imports no torch (every round);
- peak RSS <= bare import's peak + 2 x the largest output tensor + 100 MiB (layers are
  read one slice at a time: a whole stacked tensor is never held).
Run: ``.venv/bin/python benchmarks/megatron_hf.py [rounds] [--moe]`` (default 3; exit 0 when
met).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from export import COPY
from peak import goal_line, measure, mib, spread

HIDDEN, FFN, HEADS, GROUPS, LAYERS, VOCAB = 2048, 5632, 16, 8, 3, 32000
EXPERTS, MOE_FFN, TOPK = 8, 1408, 2
OURS = """
import sys, inspector
imported()
r = inspector.export(sys.argv[2], sys.argv[3], format="hf", progress=False)
assert r.arch == "megatron_gpt" and r.verification.ok, r.summary()
"""
MIB = 2**20


def build(tmp: Path, moe: bool = False) -> Path:
    """The HF model's weights, then the torch_dist folder the benchmark reads."""
    import json

    import torch
    from safetensors.torch import save_file

    import inspector

    head_dim = HIDDEN // HEADS
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator)

    tensors = {
        "model.embed_tokens.weight": rand(VOCAB, HIDDEN),
        "lm_head.weight": rand(VOCAB, HIDDEN),
        "model.norm.weight": rand(HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": rand(HIDDEN),
            p + "post_attention_layernorm.weight": rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": rand(GROUPS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rand(GROUPS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * head_dim),
        }
        tensors |= moe_layer(p, rand) if moe else {
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
        }
    hf = tmp / "hf"
    hf.mkdir()
    save_file(tensors, str(hf / "model.safetensors"))
    config = {"model_type": "llama", "num_attention_heads": HEADS, "num_key_value_heads": GROUPS,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
              "tie_word_embeddings": False}  # fmt: skip
    if moe:
        config |= {"model_type": "qwen3_moe", "head_dim": head_dim, "num_experts": EXPERTS,
                   "num_experts_per_tok": TOPK, "norm_topk_prob": True}  # fmt: skip
    (hf / "config.json").write_text(json.dumps(config))
    inspector.export(hf, tmp / "megatron", format="megatron", progress=False)
    shutil.rmtree(hf)
    return tmp / "megatron"


def moe_layer(p: str, rand) -> dict:
    """One Qwen3-MoE layer's qk-norm, router and experts (HF names)."""
    head_dim = HIDDEN // HEADS
    tensors = {
        p + "self_attn.q_norm.weight": rand(head_dim),
        p + "self_attn.k_norm.weight": rand(head_dim),
        p + "mlp.gate.weight": rand(EXPERTS, HIDDEN),
    }
    for e in range(EXPERTS):
        tensors |= {
            p + f"mlp.experts.{e}.gate_proj.weight": rand(MOE_FFN, HIDDEN),
            p + f"mlp.experts.{e}.up_proj.weight": rand(MOE_FFN, HIDDEN),
            p + f"mlp.experts.{e}.down_proj.weight": rand(HIDDEN, MOE_FFN),
        }
    return tensors


def compiled(prefix: Path) -> None:
    """Byte-compile the package into ``prefix``, where the measured processes read it."""
    import subprocess

    import inspector

    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    package = str(Path(inspector.__file__).parent)
    subprocess.run([sys.executable, "-m", "compileall", "-q", package], check=True)


def main(rounds: int = 3, moe: bool = False) -> int:
    largest = VOCAB * HIDDEN * 4
    runs = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        compiled(tmp / "pycache")
        src = build(tmp, moe)
        size = sum(p.stat().st_size for p in src.iterdir())
        print(f"torch_dist folder: {size / 1e9:.2f} GB, largest output tensor {mib(largest)}")
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        bare = measure("import inspector")
        for n in range(rounds):
            os.sync()
            copy = measure(COPY, str(src), str(tmp / f"copy{n}"))
            shutil.rmtree(tmp / f"copy{n}")
            os.sync()
            ours = measure(OURS, str(src), str(tmp / f"hf{n}"))
            shutil.rmtree(tmp / f"hf{n}")
            runs.append((copy, ours))
        print(f"load average after: {os.getloadavg()[0]:.2f}\n")
    ratios = [ours["work"] / copy["work"] for copy, ours in runs]
    print(f"copy + fsync work s: {spread([c['work'] for c, _ in runs])}")
    print(f"megatron -> hf work s: {spread([o['work'] for _, o in runs])}")
    rounds_text = ", ".join(f"{c['work']:.2f}/{o['work']:.2f}" for c, o in runs)
    print(f"per round, copy/export s: {rounds_text}")
    print(f"peak RSS MiB: bare import {bare['peak'] / MIB:.0f}, "
          f"export {spread([o['peak'] / MIB for _, o in runs], 0)}")  # fmt: skip
    ok = goal_line("megatron -> hf: work <= 1.5 x copy", ratios, 1.5)
    ok &= goal_line("export imported torch (0 no, 1 yes)", [o["torch"] for _, o in runs], 0,
                    every=True)  # fmt: skip
    budget = (2 * largest + 100 * MIB) / MIB
    ok &= goal_line(
        f"peak - bare import <= 2 x largest + 100 MiB ({budget:.0f} MiB)",
        [(o["peak"] - bare["peak"]) / MIB for _, o in runs],
        budget,
    )
    print("all goals met" if ok else "GOALS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    numbers = [int(a) for a in sys.argv[1:] if a.isdigit()]
    sys.exit(main(*numbers[:1], moe="--moe" in sys.argv[1:]))
