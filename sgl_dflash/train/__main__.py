"""Command line for drafter training on real data (see sgl_dflash/train/pipeline.py and docs/real_model.md).

    python -m sgl_dflash.train regenerate --num-prompts 1200 --target-layer-ids 1 10 18 27
    python -m sgl_dflash.train features --target-layer-ids 1 10 18 27   # only for responses without features
    python -m sgl_dflash.train train --steps 1500 --out sgl_dflash/assets/smollm2-135m-dflash
    python -m sgl_dflash.train all ...         # the three stages in order

Every stage is resumable: rerun the same command after an interruption.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sgl_dflash.train import pipeline


def _parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        name, _, share = part.partition(":")
        mix[name.strip()] = float(share or 1)
    return mix


def main(argv: list[str] | None = None) -> None:
    from sgl_dflash import datasets, model_import

    parser = argparse.ArgumentParser(prog="python -m sgl_dflash.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["regenerate", "features", "train", "all"])
    parser.add_argument("--target", type=Path, default=None, help="HF target dir (default: converted SmolLM2)")
    parser.add_argument("--work-dir", type=Path, default=None, help="default cache/train/<target name>")
    parser.add_argument("--out", type=Path, default=None, help="drafter output dir (default <work-dir>/drafter)")
    g = parser.add_argument_group("regenerate")
    g.add_argument("--num-prompts", type=int, default=1200)
    g.add_argument("--mix", type=_parse_mix, default=_parse_mix("sharegpt:0.35,math:0.4,python:0.25"))
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--max-prompt-tokens", type=int, default=384)
    g.add_argument("--gen-batch-size", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--backend", choices=["engine", "transformers"], default="engine",
                   help="engine: our Engine generates and records the features in the same pass; "
                        "transformers: the same with transformers' generate (the reference path)")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads for the transformers backend")
    g = parser.add_argument_group("features / train")
    g.add_argument("--target-layer-ids", type=int, nargs="+", default=None)
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--mask-token-id", type=int, default=None)
    g.add_argument("--steps", type=int, default=1000)
    g.add_argument("--batch-size", type=int, default=4)
    g.add_argument("--num-anchors", type=int, default=16)
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--save-every", type=int, default=50)
    g.add_argument("--holdout", type=int, default=8)
    g.add_argument("--init-from", default=None, help="start from this drafter checkpoint's weights")
    g.add_argument("--init-layers-from-target", action="store_true",
                   help="warm start: copy the target's last layers into the drafter")
    g.add_argument("--sampled-positions", type=int, default=5,
                   help="loss offsets per step drawn with p ~ w_k (0: all B-1 offsets every step)")
    g.add_argument("--vocab-negatives", type=int, default=None,
                   help="sampled softmax: the ids the responses use plus this many other ids per step "
                        "(default: full vocabulary)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    target = args.target or model_import.ensure_default_model()
    work_dir = args.work_dir or Path(model_import.CACHE_DIR) / "train" / Path(target).name
    out = args.out or work_dir / "drafter"
    layer_ids = args.target_layer_ids
    if layer_ids is None:
        import json

        from sgl_dflash.train import core

        n = json.loads((Path(target) / "config.json").read_text())["num_hidden_layers"]
        layer_ids = core.default_target_layer_ids(n, max(args.num_layers, 1))
    if args.stage in ("regenerate", "all"):
        prompts = pipeline.mix_prompts(datasets.load_training_prompts(), args.num_prompts, args.mix, args.seed)
        if args.backend == "engine":
            pipeline.regenerate(target, work_dir, prompts, layer_ids, max_new_tokens=args.max_new_tokens,
                                max_prompt_tokens=args.max_prompt_tokens, batch_size=args.gen_batch_size,
                                temperature=args.temperature, seed=args.seed)
        else:
            pipeline.regenerate_with_features(
                target, work_dir, prompts, layer_ids, max_new_tokens=args.max_new_tokens,
                max_prompt_tokens=args.max_prompt_tokens, batch_size=args.gen_batch_size,
                temperature=args.temperature, seed=args.seed, num_threads=args.num_threads)
    if args.stage == "features":  # responses generated without features (e.g. an older run)
        pipeline.compute_features(target, work_dir, layer_ids)
    if args.stage in ("train", "all"):
        train_args = pipeline.TrainArgs(
            num_layers=args.num_layers, block_size=args.block_size, target_layer_ids=tuple(layer_ids),
            mask_token_id=args.mask_token_id, steps=args.steps, batch_size=args.batch_size,
            num_anchors=args.num_anchors, lr=args.lr, seed=args.seed, save_every=args.save_every,
            holdout=args.holdout, sampled_positions=args.sampled_positions or None, vocab_negatives=args.vocab_negatives,
            num_threads=args.num_threads, init_from=args.init_from,
            init_layers_from_target=args.init_layers_from_target)
        print(pipeline.train(target, work_dir, out, train_args))


if __name__ == "__main__":
    main()
