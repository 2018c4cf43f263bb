"""Drafter training on the kept response set (data/<target>/; see docs/training.md).

    python -m sgl_dflash.train regenerate --num-prompts 2000      # grow the set with our Engine
    python -m sgl_dflash.train regenerate --followups --max-prompt-tokens 768   # multi-turn chats
    python -m sgl_dflash.train import FILE.jsonl.gz --sampling greedy --generated-by "..."
    python -m sgl_dflash.train verify --num 16 --tokens 160       # imported rows == our Engine?
    python -m sgl_dflash.train train --out DIR --time-budget-s 1200   # CUDA if present, else CPU
    python -m sgl_dflash.train eval --draft DIR                   # held-out teacher-forced tau
    python -m sgl_dflash.train token-map --out DIR/token_map.json # the ids the responses use
                                         [--max-ids N]           #   (only the N most frequent)
    python -m sgl_dflash.train curve --runs DIR... --out docs/training/learning_curve

Every command is resumable: rerun it after an interruption.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        name, _, share = part.partition(":")
        mix[name.strip()] = float(share or 1)
    return mix


def _set_dir(args) -> Path:
    from sgl_dflash.tools.train.responses import default_set_dir

    return args.set or default_set_dir(Path(args.target).name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sgl_dflash.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["regenerate", "import", "verify", "train", "eval", "token-map", "curve"])
    parser.add_argument("files", nargs="*", type=Path, help="import: JSONL(.gz) files of responses")
    parser.add_argument("--target", type=Path, default=None, help="HF target dir (default: converted SmolLM2)")
    parser.add_argument("--set", type=Path, default=None, help="response set dir (default data/<target name>)")
    parser.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("regenerate / import / verify")
    g.add_argument("--num-prompts", type=int, default=2000)
    g.add_argument("--followups", action="store_true",
                   help="regenerate: later turns of ShareGPT conversations, after the set's greedy earlier answers")
    g.add_argument("--mix", type=_parse_mix, default=_parse_mix("sharegpt:0.5,math:0.3,python:0.2"))
    g.add_argument("--max-new-tokens", type=int, default=512)
    g.add_argument("--max-prompt-tokens", type=int, default=384)
    g.add_argument("--batch-size", type=int, default=32, help="regenerate/verify: requests decoded together")
    g.add_argument("--shard-size", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sampling", default=None, help="import: how the rows were sampled ('greedy', ...)")
    g.add_argument("--generated-by", default="", help="import: what generated the rows")
    g.add_argument("--num", type=int, default=16, help="verify: rows to re-generate")
    g.add_argument("--tokens", type=int, default=160, help="verify: tokens compared per row")
    g = parser.add_argument_group("train / eval")
    g.add_argument("--out", type=Path, default=None, help="drafter output dir (token-map: the JSON file)")
    g.add_argument("--draft", type=Path, default=None, help="eval: drafter checkpoint dir")
    g.add_argument("--runs", type=Path, nargs="*", default=[], help="curve: drafter dirs written by train")
    g.add_argument("--extra", type=Path, default=None, help="curve: JSON list of rows measured otherwise")
    g.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    g.add_argument("--num-layers", type=int, default=3)
    g.add_argument("--block-size", type=int, default=8)
    g.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8], help="eval: block sizes")
    g.add_argument("--token-map", type=Path, default=None, help="eval: draft over these ids only (JSON list)")
    g.add_argument("--max-ids", type=int, default=None, help="token-map: keep the N most frequent ids")
    g.add_argument("--num-feature-layers", type=int, default=5)
    g.add_argument("--target-layer-ids", type=int, nargs="+", default=None)
    g.add_argument("--mask-token-id", type=int, default=None)
    g.add_argument("--max-anchors", type=int, default=512)
    g.add_argument("--tokens-per-batch", type=int, default=16384)
    g.add_argument("--max-seq-len", type=int, default=1024,
                   help="prompt + response tokens kept per row (a multi-turn follow-up may be up to 1,024 + 512)")
    g.add_argument("--epochs", type=float, default=4.0)
    g.add_argument("--time-budget-s", type=float, default=None, help="fit the schedule into this many seconds")
    g.add_argument("--max-steps-this-call", type=int, default=None, help="stop (state saved) after n steps")
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--train-sampling", default=None, help="train only on shards with this sampling (e.g. greedy)")
    g.add_argument("--no-trim-loops", action="store_true")
    g.add_argument("--holdout", type=int, default=64)
    g.add_argument("--init-from", default=None)
    g.add_argument("--init-layers-from-target", action="store_true")
    g.add_argument("--feature-noise", type=float, default=0.0)
    g.add_argument("--save-every-s", type=float, default=300.0)
    g.add_argument("--dflash2", action="store_true", help="train a DFlash 2 drafter (convolutions + selector)")
    g.add_argument("--conv-kernel-size", type=int, default=2)
    g.add_argument("--conv-group-size", type=int, default=64)
    g.add_argument("--selector-rank", type=int, default=64)
    g.add_argument("--selector-top-k", type=int, default=8)
    g.add_argument("--selector-alpha", type=float, default=1.0)
    args = parser.parse_args(argv)

    from sgl_dflash.tools import model_import

    args.target = args.target or model_import.ensure_default_model()
    if args.command == "regenerate":
        from sgl_dflash.tools import datasets
        from sgl_dflash.tools.train import regenerate

        first_turns = datasets.load_training_prompts()
        if args.followups:
            from transformers import AutoTokenizer

            from sgl_dflash.tools.train.responses import ResponseSet

            prompts = regenerate.followup_prompts(ResponseSet.load(_set_dir(args)), first_turns,
                                                  datasets.load_training_followups(),
                                                  AutoTokenizer.from_pretrained(args.target))[: args.num_prompts]
        else:
            prompts = regenerate.mix_prompts(first_turns, args.num_prompts, args.mix, args.seed)
        out = regenerate.regenerate(args.target, _set_dir(args), prompts, max_new_tokens=args.max_new_tokens,
                                    max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size,
                                    shard_size=args.shard_size, temperature=args.temperature, top_p=args.top_p,
                                    seed=args.seed)
        print(json.dumps(out.manifest["totals"], indent=1))
    elif args.command == "import":
        from sgl_dflash.tools.train.responses import ResponseSet, read_jsonl_rows, target_identity

        if not args.files or not args.sampling:
            parser.error("import needs FILE(s) and --sampling")
        responses = ResponseSet.open(_set_dir(args), target_identity(args.target))
        for path in args.files:
            rows = read_jsonl_rows(path)
            for start in range(0, len(rows), 4096):  # shards of ~1.5M tokens: small git objects
                n = responses.append(rows[start : start + 4096], sampling=args.sampling,
                                     generated_by=args.generated_by, source_note=path.name)
                print(f"{path.name}: +{n} responses")
        print(json.dumps(responses.manifest["totals"], indent=1))
    elif args.command == "verify":
        from sgl_dflash.tools.train import regenerate
        from sgl_dflash.tools.train.responses import ResponseSet, _write_json

        result = regenerate.verify(args.target, _set_dir(args), num=args.num, tokens=args.tokens, seed=args.seed)
        print(json.dumps(result, indent=1))
        responses = ResponseSet.load(_set_dir(args))
        responses.manifest.setdefault("checks", []).append({k: v for k, v in result.items() if k != "set"})
        _write_json(responses.path / "manifest.json", responses.manifest)
    elif args.command == "train":
        from sgl_dflash.tools.train import trainer
        from sgl_dflash.tools.train.responses import ResponseSet

        cfg = trainer.TrainConfig(
            num_layers=args.num_layers, block_size=args.block_size, num_feature_layers=args.num_feature_layers,
            target_layer_ids=tuple(args.target_layer_ids) if args.target_layer_ids else None,
            mask_token_id=args.mask_token_id, max_anchors=args.max_anchors, tokens_per_batch=args.tokens_per_batch,
            max_seq_len=args.max_seq_len,
            epochs=args.epochs, time_budget_s=args.time_budget_s, lr=args.lr, sampling=args.train_sampling,
            trim_loops=not args.no_trim_loops, holdout=args.holdout, init_from=args.init_from,
            init_layers_from_target=args.init_layers_from_target, feature_noise=args.feature_noise,
            save_every_s=args.save_every_s, seed=args.seed, selector_alpha=args.selector_alpha,
            dflash2={"conv_kernel_size": args.conv_kernel_size, "conv_group_size": args.conv_group_size,
                     "selector_rank": args.selector_rank, "selector_top_k": args.selector_top_k}
            if args.dflash2 else None)
        out = args.out or Path(model_import.CACHE_DIR) / "train" / f"{Path(args.target).name}-drafter"
        summary = trainer.train(args.target, ResponseSet.load(_set_dir(args)), out, cfg, device=args.device,
                                max_steps_this_call=args.max_steps_this_call)
        print(json.dumps({k: summary.get(k) for k in ("steps_done", "total_steps", "train_seconds",
                                                      "recent_train_loss", "held_out")}, indent=1))
    elif args.command == "eval":
        from sgl_dflash.tools.train import trainer
        from sgl_dflash.tools.train.responses import ResponseSet

        if args.draft is None:
            parser.error("eval needs --draft DIR")
        token_map = None if args.token_map is None else json.loads(args.token_map.read_text())
        print(json.dumps(trainer.evaluate_checkpoint(args.target, ResponseSet.load(_set_dir(args)), args.draft,
                                                     args.block_sizes, holdout=args.holdout, device=args.device,
                                                     token_map=token_map),
                         indent=1))
    elif args.command == "token-map":
        from sgl_dflash.tools.train.responses import ResponseSet

        if args.out is None:
            parser.error("token-map needs --out FILE")
        responses = ResponseSet.load(_set_dir(args))
        ids = responses.used_token_ids(args.max_ids)
        counts = responses.token_counts()
        args.out.write_text(json.dumps(ids) + "\n")
        print(f"{args.out}: {len(ids)} token ids, {counts[ids].sum() / max(1, counts.sum()):.2%} of response tokens")
    elif args.command == "curve":
        from sgl_dflash.tools.train.curve import run_row, write_curve

        if args.out is None:
            parser.error("curve needs --out PATH (without suffix)")
        rows = [run_row(d) for d in args.runs] + (json.loads(args.extra.read_text()) if args.extra else [])
        print(*write_curve(rows, args.out))


if __name__ == "__main__":
    main()
