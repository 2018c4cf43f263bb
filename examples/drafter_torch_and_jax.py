"""One DFlash drafter module, run in torch eager and through torchax on JAX: same drafts.

    python examples/drafter_torch_and_jax.py                       # tiny random models
    python examples/drafter_torch_and_jax.py --target-dir T --draft-dir D   # real checkpoints

A few greedy speculative steps are run with a transformers target verifying the blocks; at each
step the eager drafter (`TorchDrafter`) and the jitted JAX drafter (`DFlashProposer`) are given the
same committed context and must propose the same tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from torchax_proposer import DFlashConfig, DFlashDraftModel, DFlashProposer, TorchDrafter, load_draft_model


def tiny_models(workdir: Path) -> tuple[Path, Path]:
    """A random 4-layer Qwen3 target and a random 2-layer drafter for it, saved like the real ones."""
    target = Qwen3ForCausalLM(
        Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1)
    )
    target.save_pretrained(workdir / "target")
    draft_config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "vocab_size": 512, "num_target_layers": 4,
        "dflash_config": {"mask_token_id": 511, "target_layer_ids": [1, 2], "block_size": 8},
    }
    drafter = DFlashDraftModel(DFlashConfig.from_dict(draft_config))
    (workdir / "draft").mkdir()
    (workdir / "draft" / "config.json").write_text(json.dumps(draft_config))
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, workdir / "draft" / "model.safetensors")
    return workdir / "target", workdir / "draft"


def features(target, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Context features: outputs of the chosen target layers (hidden_states[l + 1]), concatenated."""
    with torch.no_grad():
        hidden_states = target(ids[None], output_hidden_states=True).hidden_states
    return torch.cat([hidden_states[layer + 1][0] for layer in layer_ids], dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-dir", type=Path)
    parser.add_argument("--draft-dir", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    workdir = Path(tempfile.mkdtemp())
    target_dir, draft_dir = (args.target_dir, args.draft_dir) if args.target_dir else tiny_models(workdir)

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target_config = {k: target.config.get_text_config().to_dict()[k] for k in ("hidden_size", "vocab_size", "num_hidden_layers")}
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()

    eager = TorchDrafter(load_draft_model(draft_dir, target_config), embed, lm_head)
    jax_drafter = DFlashProposer(
        draft_dir, target_embed=embed.numpy(), target_lm_head=lm_head.numpy(), target_config=target_config,
        max_num_seqs=1, max_context_len=512,
    )
    block, layer_ids = jax_drafter.block_size, jax_drafter.target_layer_ids

    ids = torch.randint(0, target_config["vocab_size"] - 1, (12,))
    prompt_features = features(target, ids, layer_ids)
    eager.add(0, prompt_features)
    jax_drafter.add(0, prompt_features.numpy())
    with torch.no_grad():
        bonus = int(target(ids[None]).logits[0, -1].argmax())

    for step in range(args.steps):
        torch_tokens, torch_logits = eager.propose([0], [bonus], return_logits=True)
        jax_tokens, jax_logits = jax_drafter.propose([0], [bonus], return_logits=True)
        print(
            f"step {step}: context {jax_drafter.committed_len(0):3d}  drafts {jax_tokens[0].tolist()}  "
            f"same tokens: {bool((torch_tokens.numpy() == jax_tokens).all())}  "
            f"max |logit diff| {np.abs(torch_logits.numpy() - jax_logits).max():.2e}"
        )
        # Greedy verification by the target: accept drafts while they match its argmax.
        candidate = torch.cat([ids, torch.tensor([bonus]), torch.tensor(jax_tokens[0]).long()])
        with torch.no_grad():
            predicted = target(candidate[None]).logits[0, len(ids) :].argmax(-1)
        matches = (candidate[len(ids) + 1 :] == predicted[:-1]).int()
        accepted = int(matches.cumprod(0).sum())
        ids = candidate[: len(ids) + accepted + 1]
        new_rows = features(target, ids, layer_ids)[-(accepted + 1) :]
        eager.commit([0], [accepted], [new_rows])
        jax_drafter.commit([0], [accepted], [new_rows.numpy()])
        bonus = int(predicted[accepted])
    print(f"jit compilations: {jax_drafter.num_compilations()}  (block size {block})")


if __name__ == "__main__":
    main()
