"""Server/engine arguments with SGLang's names and command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from sgl_dflash.errors import ServerArgsError
from sgl_dflash.model_config import read_model_config
from sgl_dflash.speculative.spec_algorithm import SpeculativeAlgorithm


DTYPES = ("auto", "float32", "bfloat16")
LAYER_LOOPS = ("scan", "switch", "unrolled", "auto")  # jax_backend.runner.LAYER_LOOPS (this module imports no jax)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclasses.dataclass
class ServerArgs:
    model_path: str
    tokenizer_path: str | None = None
    skip_tokenizer_init: bool = False
    served_model_name: str | None = None
    dtype: str = "auto"  # "auto" = float32 on CPU, bfloat16 on accelerators
    page_size: int = 16
    max_total_tokens: int = 8192  # KV cache capacity in tokens (the page budget)
    max_running_requests: int = 32
    max_prefill_tokens: int = 8192  # prompt tokens per prefill step
    context_length: int | None = None  # default: the target's max_position_embeddings
    speculative_algorithm: str | None = None  # None / "NONE" / "DFLASH"
    speculative_draft_model_path: str | None = None
    speculative_num_draft_tokens: int | None = None  # DFLASH block size; default: the drafter's
    # DFLASH: choose per request and per step how many drafts to verify (0 .. block - 1), by
    # expected tokens per second; --speculative-num-draft-tokens is then the upper bound.
    speculative_adaptive: bool = False
    # Hot-token map (SGLang's FR-Spec flag): the drafter's argmax runs over these token ids only.
    speculative_token_map: str | None = None
    random_seed: int = 0
    # How the target runs its decoder layers (jax_backend/model.py `forward`): "auto" (the scan,
    # and on a CPU the switch for decode steps of >= 16 sequences; a second copy of the layer
    # weights; docs/performance.md section 20), "scan" (one lax.scan over the stacked weights;
    # compile time flat in depth), "switch" (a scan into one branch per layer: no per-step copies
    # of the weights; faster with many sequences on a CPU, slower with few, section 19) or
    # "unrolled" (straight-line code: the bare jitted step on an H100 3.83 -> 2.63 ms, section 15;
    # slower on a CPU). The last two compile several times longer. `unroll_layers=True`
    # (--unroll-layers) is the older spelling of "unrolled".
    layer_loop: str = "auto"
    unroll_layers: bool = False
    # JAX's persistent compilation cache (sgl_dflash/compilation_cache.py): None = the default
    # directory ($SGL_DFLASH_COMPILATION_CACHE_DIR, else ~/.cache/sgl_dflash/...), "none" = off.
    compilation_cache_dir: str | None = None
    # Adaptive DFLASH compiles every verify shape and draft program its policy can choose before
    # serving (speculative/precompile.py). SGLang-JAX's flag; $SGL_DFLASH_DISABLE_PRECOMPILE=1 too.
    disable_precompile: bool = dataclasses.field(default_factory=lambda: _precompile_disabled_by_env())
    # Python's garbage collector (managers/gc_control.py): a server freezes the objects startup
    # built out of its full passes, unless disabled (an in-process Engine only on freeze_gc());
    # SGLang's flag logs passes longer than this many seconds (0: none).
    disable_gc_freeze: bool = False
    gc_warning_threshold_secs: float = 0.0
    # Scale-out (docs/scale.md), SGLang's flags: tensor parallel = the target's params and KV pages
    # sharded over tp_size devices (jax_backend/sharding.py); data parallel = dp_size servers behind
    # sglang-router (launch_server only: sgl_dflash/entrypoints/data_parallel.py).
    tp_size: int = 1
    dp_size: int = 1
    # Engine only (no CLI flag: the HTTP server is one process): tensor parallel across hosts.
    # Every host runs the same Engine calls; jax.distributed.initialize(dist_init_addr, nnodes,
    # node_rank) joins them, and tp_size counts the devices of all hosts.
    dist_init_addr: str | None = None  # "host:port" of node 0's coordinator
    nnodes: int = 1
    node_rank: int = 0
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = "info"
    # Request limits (HTTP server). SGLang's flag: clip prompt / max_new_tokens to the context
    # instead of refusing the request.
    allow_auto_truncate: bool = False
    max_request_body_bytes: int = 32 * 1024 * 1024  # larger bodies get 413
    request_timeout: float | None = None  # seconds from validation to the last token; then 503
    # Engine only (no CLI flag): NONE records these target layers' outputs for every token and
    # returns them as meta_info["aux_hidden_states"] (drafter training data in one pass).
    aux_hidden_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.speculative_algorithm is not None:
            self.speculative_algorithm = str(self.speculative_algorithm).upper()
        if self.model_path is not None:
            self.model_path = os.fspath(self.model_path)
        if self.speculative_draft_model_path is not None:
            self.speculative_draft_model_path = os.fspath(self.speculative_draft_model_path)

    # -- derived values -------------------------------------------------------------------
    @property
    def resolved_tokenizer_path(self) -> str:
        return self.tokenizer_path or self.model_path

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        import jax

        return "float32" if jax.default_backend() == "cpu" else "bfloat16"

    def target_config(self) -> dict[str, Any]:
        return read_model_config(self.model_path, "--model-path")

    # -- validation -----------------------------------------------------------------------
    def check(self) -> "ServerArgs":
        """Refuse invalid values and combinations; fills `context_length` and algorithm defaults."""
        target = self.target_config()
        if self.tokenizer_path is not None and not os.path.isdir(self.tokenizer_path):
            raise ServerArgsError(f"--tokenizer-path {self.tokenizer_path!r} is not a directory")
        if self.dtype not in DTYPES:
            raise ServerArgsError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.unroll_layers and self.layer_loop not in ("auto", "unrolled"):
            raise ServerArgsError(f"--unroll-layers contradicts --layer-loop {self.layer_loop}")
        self.layer_loop = "unrolled" if self.unroll_layers else self.layer_loop
        if self.layer_loop not in LAYER_LOOPS:
            raise ServerArgsError(f"--layer-loop must be one of {LAYER_LOOPS}, got {self.layer_loop!r}")
        if self.log_level not in LOG_LEVELS:
            raise ServerArgsError(f"--log-level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        _require_int(self.page_size, "--page-size", minimum=1)
        _require_int(self.max_total_tokens, "--max-total-tokens", minimum=self.page_size)
        _require_int(self.max_running_requests, "--max-running-requests", minimum=1)
        _require_int(self.max_prefill_tokens, "--max-prefill-tokens", minimum=1)
        _require_int(self.random_seed, "--random-seed", minimum=0)
        self._check_parallel(target)
        _require_int(self.port, "--port", minimum=0)
        _require_int(self.max_request_body_bytes, "--max-request-body-bytes", minimum=1)
        if self.request_timeout is not None:
            _require_seconds(self.request_timeout, "--request-timeout", zero_allowed=False)
        _require_seconds(self.gc_warning_threshold_secs, "--gc-warning-threshold-secs", zero_allowed=True)
        max_positions = int(target.get("max_position_embeddings") or 0)
        if self.context_length is None:
            self.context_length = max_positions or self.max_total_tokens
        _require_int(self.context_length, "--context-length", minimum=2)
        if max_positions and self.context_length > max_positions:
            raise ServerArgsError(
                f"--context-length {self.context_length} exceeds the target's "
                f"max_position_embeddings {max_positions}"
            )

        algorithm = SpeculativeAlgorithm.from_string(self.speculative_algorithm)
        self.speculative_algorithm = None if algorithm.is_none() else algorithm.name
        if algorithm.is_none():
            if self.speculative_draft_model_path is not None:
                raise ServerArgsError(
                    "--speculative-draft-model-path was given but --speculative-algorithm is NONE; "
                    "pass --speculative-algorithm DFLASH to use the drafter"
                )
            if self.speculative_num_draft_tokens is not None:
                raise ServerArgsError(
                    "--speculative-num-draft-tokens was given but --speculative-algorithm is NONE"
                )
            if self.speculative_token_map is not None:
                raise ServerArgsError("--speculative-token-map was given but --speculative-algorithm is NONE")
            if self.speculative_adaptive:
                raise ServerArgsError("--speculative-adaptive was given but --speculative-algorithm is NONE")
        if not isinstance(self.speculative_adaptive, bool):
            raise ServerArgsError(f"speculative_adaptive must be True or False, got {self.speculative_adaptive!r}")
        if self.aux_hidden_layers is not None:
            self._check_aux_hidden_layers(algorithm, int(target.get("num_hidden_layers") or 0))
        if algorithm.validate_server_args is not None:
            algorithm.validate_server_args(self)
        return self

    def _check_parallel(self, target: dict[str, Any]) -> None:
        """Sizes only (config.json); the device count is checked where the devices are: when the
        target is placed (jax_backend.sharding.check_tp_size)."""
        _require_int(self.tp_size, "--tp-size", minimum=1)
        _require_int(self.dp_size, "--dp-size", minimum=1)
        self.check_distributed()
        heads = target.get("num_attention_heads")
        for key, count in (
            ("num_key_value_heads", target.get("num_key_value_heads") or heads),
            ("num_attention_heads", heads),
            ("intermediate_size", target.get("intermediate_size")),
        ):
            if isinstance(count, int) and count % self.tp_size:
                raise ServerArgsError(
                    f"--tp-size {self.tp_size} does not divide the target's {key} ({count}): every "
                    f"device must hold whole attention heads and an equal share of the MLP"
                )

    def check_distributed(self) -> None:
        _require_int(self.nnodes, "nnodes", minimum=1)
        _require_int(self.node_rank, "node_rank", minimum=0)
        if self.node_rank >= self.nnodes:
            raise ServerArgsError(f"node_rank {self.node_rank} must be < nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ServerArgsError("nnodes > 1 needs dist_init_addr (host:port of node 0's coordinator)")

    def _check_aux_hidden_layers(self, algorithm: Any, num_layers: int) -> None:
        if not algorithm.is_none():
            raise ServerArgsError("aux_hidden_layers is only supported with --speculative-algorithm NONE")
        layers = list(self.aux_hidden_layers)
        bad = [l for l in layers if isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < num_layers]
        if not layers or bad or len(set(layers)) != len(layers):
            raise ServerArgsError(
                f"aux_hidden_layers must be distinct layer indices in [0, {num_layers}), got {layers!r}"
            )
        self.aux_hidden_layers = tuple(layers)

    # -- command line ---------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = ServerArgs.__dataclass_fields__
        add = parser.add_argument
        add("--model-path", "--model", dest="model_path", required=True,
            help="target model directory (HF config.json + safetensors)")
        add("--tokenizer-path", default=None, help="tokenizer directory (default: --model-path)")
        add("--skip-tokenizer-init", action="store_true",
            help="take and return token ids only; no tokenizer is loaded")
        add("--served-model-name", default=None, help="model name reported by the API")
        add("--dtype", default=d["dtype"].default, choices=DTYPES)
        add("--page-size", type=int, default=d["page_size"].default)
        add("--max-total-tokens", type=int, default=d["max_total_tokens"].default,
            help="KV cache capacity in tokens")
        add("--max-running-requests", type=int, default=d["max_running_requests"].default)
        add("--max-prefill-tokens", type=int, default=d["max_prefill_tokens"].default)
        add("--context-length", type=int, default=None)
        add("--speculative-algorithm", default=None, help="NONE or DFLASH (or a plugin's name)")
        add("--speculative-draft-model-path", "--speculative-draft-model", default=None,
            dest="speculative_draft_model_path")
        add("--speculative-num-draft-tokens", "--speculative-dflash-block-size", type=int,
            default=None, dest="speculative_num_draft_tokens",
            help="DFLASH block size (default: the drafter's block_size); with --speculative-adaptive "
                 "the upper bound of a verify block, clipped to the drafter's block_size")
        add("--speculative-adaptive", action="store_true",
            help="DFLASH: choose per request and per step how many drafts to verify (0 = a plain "
                 "decode step), maximizing expected tokens per second (docs/adaptive.md)")
        add("--speculative-token-map", default=None,
            help="JSON list of token ids the drafter may propose (its lm_head shrinks to them); default: "
                 "the map the drafter's config.json names, if any; 'none': the whole vocabulary")
        add("--random-seed", type=int, default=d["random_seed"].default)
        add("--layer-loop", choices=LAYER_LOOPS, default=d["layer_loop"].default,
            help="how the target runs its decoder layers: auto (default: scan, and on a CPU switch for decode "
                 "steps of >= 16 requests, which keeps a second copy of the layer weights), scan, switch (no "
                 "per-step weight copies) or unrolled (for accelerators); switch and unrolled compile several "
                 "times longer (docs/performance.md sections 19-20)")
        add("--unroll-layers", action="store_true", help="the same as --layer-loop unrolled")
        add("--disable-precompile", action="store_true", default=_precompile_disabled_by_env(),
            help="with --speculative-adaptive: compile programs when first met instead of sweeping them at "
                 "startup (a shorter startup, stalls while serving)")
        add("--disable-gc-freeze", action="store_true",
            help="leave Python's garbage collector as it is; by default the server freezes the objects startup "
                 "built (~1.5M) out of its full passes once it is ready (docs/server.md)")
        add("--gc-warning-threshold-secs", type=float, default=d["gc_warning_threshold_secs"].default,
            help="log a warning for every garbage collection longer than this many seconds (0: never)")
        add("--compilation-cache-dir", default=None,
            help="JAX's persistent compilation cache: compiled programs are kept here and loaded by later "
                 "runs (default: $SGL_DFLASH_COMPILATION_CACHE_DIR, else ~/.cache/sgl_dflash/"
                 "jax_compilation_cache; 'none' turns it off)")
        add("--tp-size", "--tensor-parallel-size", type=int, default=d["tp_size"].default, dest="tp_size",
            help="tensor parallel: shard the target over this many devices (it must divide the KV heads)")
        add("--dp-size", "--data-parallel-size", type=int, default=d["dp_size"].default, dest="dp_size",
            help="data parallel: this many servers behind sglang-router on --host/--port")
        add("--host", default=d["host"].default)
        add("--port", type=int, default=d["port"].default)
        add("--api-key", default=None)
        add("--log-level", default=d["log_level"].default, choices=LOG_LEVELS)
        add("--allow-auto-truncate", action="store_true",
            help="truncate prompts longer than the context and clip max_new_tokens to the room left, "
                 "instead of refusing the request (400)")
        add("--max-request-body-bytes", type=int, default=d["max_request_body_bytes"].default,
            help="refuse larger request bodies with 413")
        add("--request-timeout", type=float, default=None,
            help="seconds a request may take (queued + running); then it is aborted (503)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def _precompile_disabled_by_env() -> bool:
    return os.environ.get("SGL_DFLASH_DISABLE_PRECOMPILE", "0") not in ("", "0")


def _require_int(value: Any, flag: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ServerArgsError(f"{flag} must be an integer >= {minimum}, got {value!r}")


def _require_seconds(value: Any, flag: str, *, zero_allowed: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 <= value if zero_allowed else 0 < value) or value == float("inf"):
        raise ServerArgsError(f"{flag} must be a number of seconds {'>=' if zero_allowed else '>'} 0, got {value!r}")

