"""The engines a throughput bench compares, and their command-line flags: NONE, any fixed DFLASH
blocks and --speculative-adaptive, built with the engine's defaults (`bench_concurrency`,
`bench_batches`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from sgl_dflash import tools


def make_engines(args) -> dict:
    engines = {"NONE": _engine(args)}
    for block in args.block_sizes:
        engines[f"B={block}"] = _engine(args, speculative_num_draft_tokens=block)
    engines["adaptive"] = adaptive_engine(args)
    return engines


def adaptive_engine(args):
    """The bench's adaptive engine (also the second one of the in-process A/B records in docs/adaptive)."""
    return _engine(args, speculative_num_draft_tokens=args.adaptive_bound, speculative_adaptive=True)


def _engine(args, **spec):
    """NONE's engine, or with `spec` (the draft tokens, adaptive) a DFLASH one with the bench's drafter."""
    from sgl_dflash.entrypoints.engine import Engine

    if spec:
        spec.update(speculative_algorithm="DFLASH", speculative_draft_model_path=args.draft_model_path,
                    speculative_token_map=args.speculative_token_map)
    return Engine(model_path=args.model_path, random_seed=0, **spec)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the engines a bench builds (`make_engines`), its compilation cache and output."""
    from sgl_dflash.tools.demo import DEFAULT_DRAFTER

    parser.add_argument("--model-path", default=None, help="target HF dir (default: converted SmolLM2-135M)")
    parser.add_argument("--draft-model-path", default=None, help=f"drafter (default: {DEFAULT_DRAFTER})")
    parser.add_argument("--speculative-token-map", default=None, help=tools.TOKEN_MAP_HELP)
    parser.add_argument("--adaptive-bound", type=int, default=16, help="adaptive's --speculative-num-draft-tokens")
    parser.add_argument("--compilation-cache", type=Path, default=tools.CACHE_DIR / "jax_compilation_cache")
    parser.add_argument("--out", type=Path, default=tools.REPO_ROOT / "bench_results")


def resolve_engine_args(args: argparse.Namespace) -> None:
    """Default model and drafter paths (the target is converted on first use); the compilation
    cache on."""
    from sgl_dflash.tools import model_import
    from sgl_dflash.tools.demo import DEFAULT_DRAFTER, use_compilation_cache

    args.model_path = args.model_path or str(model_import.ensure_default_model())
    args.draft_model_path = args.draft_model_path or str(DEFAULT_DRAFTER)
    use_compilation_cache(args.compilation_cache)
