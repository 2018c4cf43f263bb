"""SGLang's server arguments and requests, as our JAX workers can serve them.

- `apply_platform_defaults`: the platform's `apply_server_args_defaults` (SGLang runs it inside
  its argument resolution, arg_groups/platform_hook.py::handle_platform_defaults; what it assigns
  becomes the resolved value). Forces what our worker needs and refuses, with a message naming the
  flag, what it cannot serve.
- `dflash_server_args`: this package's `ServerArgs` (the fields our workers read) from SGLang's.
- `unsupported_request`: the reason a request cannot be served (SGLang answers it 400), checked
  through an AROUND hook on `sglang.srt.managers.utils.validate_input_length` (sglang_plugin.py).
"""

from __future__ import annotations

import logging
from typing import Any

from sgl_dflash.server_args import ServerArgs

logger = logging.getLogger(__name__)

PLATFORM = "the dflash_jax platform (sgl-dflash: JAX target, torchax drafter)"
DEFAULT_MAX_TOTAL_TOKENS = ServerArgs.__dataclass_fields__["max_total_tokens"].default
DEFAULT_MAX_RUNNING_REQUESTS = ServerArgs.__dataclass_fields__["max_running_requests"].default


def apply_platform_defaults(args: Any) -> None:
    """Reads the user's values on SGLang's resolving record `args` and assigns the resolved ones."""

    def refuse(flag: str, value: Any, why: str) -> None:
        raise ValueError(f"{flag} {value!r} is not supported by {PLATFORM}: {why}")

    algorithm = args.speculative_algorithm
    if algorithm is not None and str(algorithm).upper() not in ("DFLASH", "NONE"):
        refuse("--speculative-algorithm", algorithm, "it serves DFLASH (or no speculative algorithm)")
    for flag in ("tp_size", "pp_size", "dp_size"):
        value = getattr(args, flag, 1)
        if value not in (None, 1):
            refuse(f"--{flag.replace('_', '-')}", value, "one JAX process serves the model (a Mesh is the way to "
                   "shard it; run replicas behind SGLang's router for data parallel)")
    if args.page_size not in (None, 1):
        refuse("--page-size", args.page_size, "SGLang's token slot s is our KV page s (page size 1)")
    if getattr(args, "enable_lora", False) or getattr(args, "lora_paths", None):
        refuse("--enable-lora", True, "LoRA adapters are torch modules")
    if getattr(args, "enable_mixed_chunk", False):
        refuse("--enable-mixed-chunk", True, "a batch is either prefill chunks or decode steps")
    if getattr(args, "enable_torch_compile", False):
        refuse("--enable-torch-compile", True, "the model runs in JAX (jit-compiled already)")
    if args.dtype not in (None, "auto", "float32", "bfloat16"):
        refuse("--dtype", args.dtype, "use auto, float32 or bfloat16")

    if algorithm is not None and str(algorithm).upper() == "DFLASH":
        # Before SGLang's _handle_dflash, which would default the block size to 16 when its own
        # parser does not read our drafter's config: ours reads it, and checks that the drafter
        # fits the target (the same checks as `python -m sgl_dflash.launch_server`).
        from sgl_dflash.speculative.dflash_worker import validate_dflash_server_args

        if args.speculative_num_draft_tokens is None and args.speculative_dflash_block_size is not None:
            args.speculative_num_draft_tokens = int(args.speculative_dflash_block_size)
        validate_dflash_server_args(args)

    args.page_size = 1
    # Our workers are synchronous: a step's result is on the host when it returns.
    args.disable_overlap_schedule = True
    # No CUDA graphs: the JAX step is compiled by XLA already.
    args.disable_cuda_graph = True
    # Grammar needs a vocabulary mask inside sampling, which our jitted sampling does not take:
    # with backend "none" SGLang itself refuses json_schema / regex / ebnf requests with a message.
    args.grammar_backend = "none"
    if not args.disable_radix_cache:
        logger.info("%s: radix (prefix) cache off: the drafter needs the target features of a "
                    "cached prefix, which are not kept per token slot", PLATFORM)
    args.disable_radix_cache = True


def dflash_server_args(args: Any, context_length: int) -> ServerArgs:
    """This package's ServerArgs for our workers, from SGLang's resolved ServerArgs (`context_length`:
    SGLang's model context length, so both sides agree on the longest request)."""
    algorithm = args.speculative_algorithm
    ours = ServerArgs(
        model_path=args.model_path,
        dtype=args.dtype if args.dtype in ("float32", "bfloat16") else "auto",
        page_size=1,
        max_total_tokens=args.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS,
        max_running_requests=args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS,
        context_length=context_length,
        speculative_algorithm=None if algorithm in (None, "NONE") else str(algorithm).upper(),
        speculative_draft_model_path=args.speculative_draft_model_path,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        speculative_token_map=args.speculative_token_map,
        random_seed=args.random_seed or 0,
    )
    return ours.check()


def unsupported_request(req: Any) -> str | None:
    """Why SGLang's `Req` cannot be served by our workers, or None. Each of these would need the
    logits (or a logits edit) inside our jitted step."""
    params = req.sampling_params
    problems = []
    if req.return_logprob:
        problems.append("logprobs (return_logprob / logprobs / top_logprobs_num)")
    if getattr(req, "return_hidden_states", False):
        problems.append("return_hidden_states")
    if params.min_p > 0:
        problems.append("min_p")
    if params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0:
        problems.append("frequency / presence / repetition penalties")
    if params.min_new_tokens:
        problems.append("min_new_tokens")
    if getattr(params, "logit_bias", None):
        problems.append("logit_bias")
    if getattr(req, "custom_logit_processor", None):
        problems.append("custom_logit_processor")
    if not problems:
        return None
    return f"{PLATFORM} does not support: {', '.join(problems)}"
