"""Our drafter against the z-lab reference (`dflash` 0.1.0) on the same checkpoint directory.

The reference is driven exactly as `dflash.model.dflash_generate` drives it: a DynamicCache with
past recording, each draft a forward over [new context features ‖ block] with use_cache, then a
crop back to the committed length. Accepted counts follow a fixed schedule covering 0 .. B-1 so
the context grows by every possible amount; the features are real hidden states of a tiny random
transformers Qwen3 target, whose embedding and lm_head both drafters use.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from dflash import model as ref_lib
from transformers import DynamicCache

from tests.tiny_checkpoints import load_hf_model, make_tiny_target
from tests.tiny_draft import context_features, make_tiny_draft, single_torch_thread  # noqa: F401
from torchax_proposer import DFlashConfig, DFlashProposer, TorchDrafter, default_target_layer_ids, load_draft_model

TARGET_LAYERS = 6
PROMPT_LENS = (5, 13, 30)
NUM_STEPS = 6

CONFIGS = {
    # GQA (4 heads / 2 kv heads), explicit target layers, B=8.
    "b8_gqa_explicit_ids": dict(num_layers=2, block_size=8, target_layer_ids=[1, 4]),
    # MHA with other head sizes, default target layer ids (z-lab's rule), B=16, output scaling,
    # attention biases.
    "b16_mha_default_ids": dict(
        num_layers=3, block_size=16, num_attention_heads=8, num_key_value_heads=8, head_dim=8,
        intermediate_size=96, input_embedding_scale=1.5, output_multiplier=0.7, final_logit_softcapping=4.0,
        attention_bias=True,
    ),
    # A sliding-window (hence causal) layer next to a full one: exercises the explicit masks.
    # YaRN RoPE: scaled frequencies and an attention factor != 1.
    "b8_sliding_layer": dict(
        num_layers=2, block_size=8, target_layer_ids=[0, 2, 5], use_sliding_window=True, sliding_window=6,
        layer_types=["full_attention", "sliding_attention"],
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    ),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_tiny_target(tmp_path_factory.mktemp("target"), "qwen3", num_hidden_layers=TARGET_LAYERS)
    config = json.loads(open(f"{path}/config.json").read())
    return load_hf_model(path), config


class ReferenceDrafter:
    """One sequence through the reference model, step for step as in `dflash_generate`."""

    def __init__(self, model, target, block_size: int, prompt_features: torch.Tensor):
        self.model, self.target, self.block_size = model, target, block_size
        self.cache = DynamicCache(config=model.config)
        self.cache.activate_past_recording()
        self.target_hidden = prompt_features[None]
        self.start = prompt_features.shape[0]

    @torch.inference_mode()
    def draft(self, bonus: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = torch.full((1, self.block_size), self.model.mask_token_id, dtype=torch.long)
        block[0, 0] = bonus
        scale = float(ref_lib._draft_value(self.model.config, "input_embedding_scale", 1.0))
        noise = ref_lib._raw_input_embeddings(self.target, block, scale)
        positions = torch.arange(self.start - self.target_hidden.shape[1], self.start + self.block_size)[None]
        hidden = self.model(
            target_hidden=self.target_hidden,
            noise_embedding=noise,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
        )[:, 1 - self.block_size :, :]
        ref_lib._crop_to(self.cache, self.start)
        logits = self.model.compute_logits(hidden, ref_lib._output_head(self.target))
        return hidden[0], logits[0]

    def commit(self, features: torch.Tensor) -> None:
        self.start += features.shape[0]
        self.target_hidden = features[None]


def accepted_schedule(block_size: int, seq: int, step: int) -> int:
    # Every count 0 .. B-1 appears, and sequences of one batch get different counts.
    cycle = [0, block_size - 1, 3, 1, block_size // 2, 2, block_size - 2]
    return cycle[(step + 2 * seq) % len(cycle)]


@pytest.mark.parametrize(
    "name, serve_block",
    [("b8_gqa_explicit_ids", None), ("b16_mha_default_ids", None), ("b16_mha_default_ids", 8), ("b8_sliding_layer", None)],
)
def test_matches_reference_over_growing_context(target, tmp_path_factory, name, serve_block):
    target_model, target_config = target
    options = dict(CONFIGS[name])
    draft_dir = make_tiny_draft(tmp_path_factory.mktemp(name), target_config, seed=3, **options)

    reference, info = ref_lib.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    reference.eval()
    if name == "b8_sliding_layer":  # the reference really has a causal sliding layer and YaRN here
        assert reference.layers[1].self_attn.sliding_window == 6 and reference.layers[1].self_attn.is_causal
        assert reference.rotary_emb.rope_type == "yarn" and reference.rotary_emb.attention_scaling > 1.1
    if name == "b16_mha_default_ids":
        assert reference.layers[0].self_attn.q_proj.bias is not None

    ours = load_draft_model(draft_dir, target_config)
    assert ours.target_layer_ids == list(reference.target_layer_ids)
    block = serve_block or ours.block_size
    embed = target_model.get_input_embeddings().weight.detach()
    lm_head = target_model.lm_head.weight.detach()
    eager = TorchDrafter(ours, embed, lm_head, block_size=block)
    jax_drafter = DFlashProposer(
        draft_dir,
        target_embed=embed.numpy(),
        target_lm_head=lm_head.numpy(),
        target_config=target_config,
        max_num_seqs=4,
        max_context_len=256,
        block_size=block,
    )
    assert jax_drafter.block_size == block and jax_drafter.mask_token_id == reference.mask_token_id

    gen = torch.Generator().manual_seed(7)
    tokens = [torch.randint(3, 256, (1, n), generator=gen) for n in PROMPT_LENS]
    refs = []
    for seq, ids in enumerate(tokens):
        features = context_features(target_model, ids, ours.target_layer_ids)
        refs.append(ReferenceDrafter(reference, target_model, block, features))
        eager.add(seq, features)
        jax_drafter.add(seq, features.numpy())
    bonus = [int(b) for b in torch.randint(3, 256, (len(tokens),), generator=gen)]
    seq_ids = list(range(len(tokens)))

    for step in range(NUM_STEPS):
        jax_tokens, jax_logits = jax_drafter.propose(seq_ids, bonus, return_logits=True)
        assert jax_tokens.shape == (len(seq_ids), block - 1) and jax_tokens.dtype == np.int32
        counts, rows = [], []
        for seq in seq_ids:
            ref_hidden, ref_logits = refs[seq].draft(bonus[seq])
            our_hidden = eager.draft(seq, bonus[seq])[1:]
            torch.testing.assert_close(our_hidden, ref_hidden, atol=1e-5, rtol=0)
            np.testing.assert_allclose(jax_logits[seq], ref_logits.numpy(), atol=1e-5, rtol=0)
            ref_tokens = ref_logits.argmax(-1)
            assert (ours.compute_logits(our_hidden, lm_head).argmax(-1) == ref_tokens).all()
            assert (jax_tokens[seq] == ref_tokens.numpy()).all()

            # Verify: the block is [bonus, drafts]; the first a+1 tokens become committed.
            accepted = accepted_schedule(block, seq, step)
            block_ids = torch.tensor([[bonus[seq], *ref_tokens.tolist()]])
            tokens[seq] = torch.cat([tokens[seq], block_ids[:, : accepted + 1]], dim=1)
            features = context_features(target_model, tokens[seq], ours.target_layer_ids)[-(accepted + 1) :]
            refs[seq].commit(features)
            counts.append(accepted)
            rows.append(features)
        eager.commit(seq_ids, counts, rows)
        jax_drafter.commit(seq_ids, counts, [r.numpy() for r in rows])
        bonus = [int(b) for b in torch.randint(3, 256, (len(seq_ids),), generator=gen)]
        for seq in seq_ids:
            assert jax_drafter.committed_len(seq) == eager.committed_len(seq) == refs[seq].start
            assert refs[seq].start == tokens[seq].shape[1]


def test_default_target_layer_ids_rule_matches_reference():
    for num_target in range(4, 41):
        for num_draft in range(1, 9):
            assert default_target_layer_ids(num_target, num_draft) == ref_lib.build_target_layer_ids(num_target, num_draft)


@pytest.mark.parametrize(
    "edit",
    [
        # block_size nowhere -> 16; ids nowhere -> rule over num_target_layers
        lambda c: (c["dflash_config"].pop("block_size"), c["dflash_config"].pop("target_layer_ids")),
        # top level used when dflash_config lacks the key; dflash_config wins when both have it
        lambda c: (c.update(block_size=12, mask_token_id=7, output_multiplier=2.0), c["dflash_config"].pop("block_size")),
        lambda c: c["dflash_config"].update(output_multiplier=0.5, final_logit_softcapping=3.0, input_embedding_scale=2.0),
    ],
)
def test_config_keys_read_like_reference(target, tmp_path, edit):
    _, target_config = target
    path = make_tiny_draft(tmp_path, target_config, num_layers=2, block_size=8, target_layer_ids=[1, 3])
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))

    reference = ref_lib.DFlashDraftModel.from_pretrained(path, dtype=torch.float32)
    ours = DFlashConfig.from_pretrained(path)
    assert ours.block_size == reference.block_size
    assert ours.mask_token_id == reference.mask_token_id
    assert list(ours.target_layer_ids) == list(reference.target_layer_ids)
    for key, default in (("output_multiplier", 1.0), ("input_embedding_scale", 1.0), ("final_logit_softcapping", None)):
        assert getattr(ours, key) == ref_lib._draft_value(reference.config, key, default)
