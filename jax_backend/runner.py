"""TargetRunner: the target model's params, paged KV pool and its jitted steps (forward, sample, verify)."""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_backend import compiled_memory, model, sampling, sharding, steps
from jax_backend.batch import BatchError, SeqInput, build_batch, context_pages
from jax_backend.config import TargetConfig
from jax_backend.greedy_head import attach as attach_greedy_head
from jax_backend.kv_cache import PageAllocator
from jax_backend.layout_tuner import EXPLORE_ROOM, LayoutTuner
from jax_backend.loader import load_target
from jax_backend.outputs import AuxRows, ForwardOutput, SampleOutput, VerifyOutput
from jax_backend.paged_attention import DEFAULT_CHUNK_TOKENS


# "auto" (the default): the scan, but on a CPU decode and verify steps run the scan or the switch, whichever
# `LayoutTuner` timed faster for their shape (docs/performance.md sections 19-20, 24); else `model.forward`'s.
LAYER_LOOPS = (*model.LAYER_LOOPS, "auto")


class ContextLengthError(ValueError):
    """A sequence would run past the runner's max_model_len."""


class TargetRunner:
    """Owns the target params and KV pool; `forward` runs one packed ragged batch. Page allocation
    is the caller's job through `.allocator`. The KV pool holds `max_total_tokens` tokens (+ one
    scratch page); a sequence may span `max_model_len` (default: min(max_position_embeddings,
    max_total_tokens))."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        dtype: str = "float32",
        page_size: int = 16,
        max_total_tokens: int = 4096,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        aux_layer_ids: Sequence[int] = (),
        layer_loop: str = "auto",
        fuse_projections: bool = False,
        tp_size: int = 1,
        cpu_attention: bool | None = None,
        cpu_matmul: bool | None = None,
        gguf_blocks: bool = True,
        greedy_head: bool | None = None,
    ):
        """`layer_loop` (`LAYER_LOOPS`, `model.forward`): "auto" (default: "scan"; on a CPU decode
        and verify steps run the scan or the switch, whichever `LayoutTuner` timed faster), "scan",
        "switch" (no per-step weight copies, 2-5x the compile time; docs/performance.md sections 19,
        24) or "unrolled" (for accelerators, section 17); the switch and unrolled layouts are
        per-layer copies of the layer weights, kept beside `self.params` (the loaded stack).
        `fuse_projections`: q/k/v and gate/up as single matmuls (within noise on CPU).
        Both change XLA's float summation order only (results within float rounding).
        `tp_size` > 1: tensor parallel over the first tp_size devices (`jax_backend.sharding`).
        `cpu_attention`: the attention of decode and verify steps of <= 16 tokens per sequence
        runs the CPU kernels (`jax_backend.cpu_kernels`); None (default) = wherever it applies:
        one CPU device, float32, the kernels built. True where it cannot apply is an error.
        `cpu_matmul`: the same for the matmul kernel (`model.project`, <= 64 rows); its few-row
        products read the checkpoint's GGUF blocks (`jax_backend.blocks`) unless `gguf_blocks` is False.
        `greedy_head`: greedy steps' tokens from the greedy head kernel (`greedy_head.attach`)."""
        if layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
        self.mesh = self._tp_mesh(model_dir, tp_size, fuse_projections)
        tp_sharding = None if self.mesh is None else sharding.param_sharding(self.mesh, self._tp_config)
        self.config, self.params = load_target(model_dir, dtype, tp_sharding, gguf_blocks=gguf_blocks and cpu_matmul is not False)
        config = self.config
        aux_layer_ids = tuple(int(l) for l in aux_layer_ids)
        bad = [l for l in aux_layer_ids if not 0 <= l < config.num_hidden_layers]
        if bad:
            raise ValueError(f"aux_layer_ids {bad} out of range for {config.num_hidden_layers} layers")
        max_model_len = min(config.max_position_embeddings, max_total_tokens) if max_model_len is None else max_model_len
        if page_size < 1 or max_total_tokens < 1 or max_num_seqs < 1 or max_model_len < 1:
            raise ValueError("page_size, max_total_tokens, max_num_seqs and max_model_len must be positive, got "
                             f"{page_size}, {max_total_tokens}, {max_num_seqs} and {max_model_len}")

        self.dtype = dtype
        self.page_size = page_size
        self._min_pages = max(1, DEFAULT_CHUNK_TOKENS // page_size)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.aux_layer_ids = aux_layer_ids
        self.pages_per_seq = -(-max_model_len // page_size)
        num_pages = -(-max_total_tokens // page_size) + 1  # + scratch page 0
        self.allocator = PageAllocator(num_pages, page_size)
        shape = (config.num_hidden_layers, num_pages, page_size, 2 * config.num_key_value_heads, config.head_dim)
        self.kv_pool = self._zeros_pool(shape, self.params["embed"].dtype)
        # On a CPU: attention's loop stops at the longest prefix, the logits' matmul is vocab-major (see Batch)
        self._loop_to_longest = self._vocab_major_logits = all(d.platform == "cpu" for d in self.kv_pool.devices())
        self.cpu_attention = self._cpu_kernel(cpu_attention, "cpu_attention")
        self.cpu_matmul = self._cpu_kernel(cpu_matmul, "cpu_matmul")

        self.layer_loop, self.fuse_projections = layer_loop, fuse_projections
        if self._loop_to_longest and self.mesh is None:  # on a CPU: the weights out-major (`model.project`)
            self.params = model.out_major_layers(self.params)
        self.params = attach_greedy_head(self.params, greedy_head, self.cpu_matmul)
        # The steps' view of the weights; `self.params` keeps the stacked layout (out-major on a CPU).
        self._step_params = self._layout("scan" if layer_loop == "auto" else layer_loop)
        self._tuner = LayoutTuner() if layer_loop == "auto" and self._loop_to_longest else None  # on a CPU
        # Verify steps of at most this many sequences (the padded batch) are tuned too: an adaptive
        # worker, whose verify shapes are many, tunes only its small batches' few shapes.
        self.tuned_verify_seqs: float = math.inf
        self._unread = None  # (shape, layer loop, dispatch time) of a timed step not waited for (`step_read`)
        self._switch_params = self._layout("switch") if self._tuner else self._step_params

        def step(params, kv_pool, batch):
            return model.forward(params, config, kv_pool, batch, aux_layer_ids)

        self._step = self._jit_step(step, free_outputs=(0,))  # (logits, aux, pool)
        self._step_without_aux = self._jit_step(  # `forward(features=False)`: NONE's program
            lambda params, kv_pool, batch: model.forward(params, config, kv_pool, batch, ()), free_outputs=(0,))
        last = config.num_hidden_layers - 1
        self._norm_block = aux_layer_ids.index(last) if last in aux_layer_ids else None
        self._sample_steps: dict[str, Callable] = {}  # by sampling mode
        self._verify_steps: dict[str, Callable] = {}

    @property
    def embed(self) -> jax.Array:
        return self.params["embed"]

    @property
    def lm_head(self) -> jax.Array:
        return self.params["lm_head"]

    def hidden_state_features(self, aux: jax.Array) -> jax.Array:
        """Aux rows [q, n_aux*H] of `forward` as transformers' `hidden_states[l + 1]` (z-lab's
        drafter features): each layer's output, except that transformers reports the LAST layer
        after the final norm, so that block (if captured) is normed here."""
        if self._norm_block is None:
            return aux
        return _norm_features(aux, self.params["norm"], self._norm_block, self.config)

    def num_compilations(self) -> int:
        """Number of distinct compiled versions of the jitted steps so far."""
        jitted = [self._step, self._step_without_aux, *self._sample_steps.values(), *self._verify_steps.values()]
        return sum(fn._cache_size() for fn in jitted)

    def forward(self, seqs: Sequence[SeqInput], *, fine_tokens: bool = True, query_tiles: bool = True,
                features: bool = True) -> ForwardOutput:
        """Run prefill chunks, decodes and verify blocks for several sequences in one batch.
        The serving path runs prefills here, so token rows are padded finely (`fine_bucket`);
        `sample` and `verify` keep the power-of-two rows the adaptive policy's shapes assume.
        `fine_tokens` / `query_tiles` False: the padding and attention layout before either
        existed (`bench_prefill` compares them). `features=False`: no aux rows, none captured."""
        batch, layout = self._batch(seqs, fine_tokens=fine_tokens, query_tiles=query_tiles)
        step = self._step if features or not self.aux_layer_ids else self._step_without_aux
        logits, aux, self.kv_pool = step(self._step_params, self.kv_pool, batch)

        logits = np.asarray(logits)
        per_seq_logits = [
            logits[start : start + n] for start, n in zip(layout.logit_starts, layout.num_logits)
        ]
        return ForwardOutput(per_seq_logits, self._aux_rows(aux, layout) if features else AuxRows())

    def sample(
        self,
        seqs: Sequence[SeqInput],
        temperature: Sequence[float],
        top_p: Sequence[float],
        top_k: Sequence[int],
        key: jax.Array | None = None,
        device_features: bool = False,
        wait: bool = True,
        features: bool = True,
    ) -> SampleOutput:
        """`forward`, then one token per sequence from its last position, sampled on the device
        with per-sequence parameters (as `sampling.sample`: temperature <= 0 is the argmax; the
        same draws for the same key and logits). Only the token ids come back to the host;
        `device_features`: the drafter's features stay on the device too (`SampleOutput`); with
        `wait=False` the tokens too, unread, so that the caller's host work overlaps the step (a
        caller that calls `step_read` once it has read them times the step for the layer loop).
        `features=False`: none, not even captured: NONE's program, "<mode> without aux" (~2% faster)."""
        if any(seq.logits != "last" for seq in seqs):
            raise BatchError("sample: every sequence must ask for logits='last'")
        if not (wait or device_features):
            raise BatchError("sample: wait=False leaves the tokens on the device: it needs device_features=True")
        batch, layout = self._batch(seqs)
        rows = batch.logits_indices.shape[0]
        arrays = sampling.per_row_params(rows, 1, temperature, top_p, top_k)
        mode = sampling.sampling_mode(*arrays, self.config.vocab_size)
        if mode != "greedy" and key is None:
            raise BatchError("sample: sampling (temperature > 0) needs a key")
        program = mode if features or device_features or not self.aux_layer_ids else f"{mode} without aux"
        fn = self._jitted(self._sample_steps, program, steps.sample_step)
        tokens, aux, self.kv_pool = self._run(fn, "sample", batch, program, True, *arrays, key, wait=wait)
        tokens = np.asarray(tokens)[: len(seqs)] if wait else tokens  # wait=False: unread, on the device
        if device_features:
            return SampleOutput(tokens, device_features=self.hidden_state_features(aux))
        return SampleOutput(tokens, self._aux_rows(aux, layout) if features else AuxRows())

    def verify(
        self,
        seqs: Sequence[SeqInput],
        temperature: Sequence[float] | None = None,
        top_p: Sequence[float] | None = None,
        top_k: Sequence[int] | None = None,
        draft_probs: jax.Array | None = None,
        key: jax.Array | None = None,
        block_size: int | None = None,
    ) -> VerifyOutput:
        """Verify one block per sequence: token_ids = [bonus, d_1 .. d_k], logits "all". Blocks
        may be ragged (k = 0 is a plain decode step that still returns the next token): they run
        packed as they are, and the acceptance sees them padded to `block_size` B rows (default:
        the longest block; a fixed B keeps one compiled acceptance per batch shape) with each
        sequence's own k as its valid length. Greedy (no temperature, or all <= 0): accept while
        the drafts equal the target's argmax (`sampling.greedy_accept`). Otherwise rejection
        sampling (`sampling.rejection_accept`) with `draft_probs` q [bucket(n), B-1, V] and `key`;
        rows of a greedy sequence get one-hot p and q, which is greedy acceptance exactly."""
        lengths = [len(seq.token_ids) for seq in seqs]
        block = max(lengths, default=0) if block_size is None else block_size
        if not seqs or block < 2 or max(lengths) > block or any(seq.logits != "all" for seq in seqs):
            raise BatchError("verify: every sequence needs a block of 1 .. block_size (>= 2) tokens and logits='all'")
        if not self.aux_layer_ids:
            raise BatchError("verify returns the drafter's features: the runner needs aux_layer_ids")
        batch, layout = self._batch(seqs)
        num_seqs = batch.kv_lens.shape[0]
        n = len(seqs)
        # Block position j of sequence i is its packed row min(j, k_i): padding repeats the last row.
        offsets = np.minimum(np.arange(block, dtype=np.int32)[None, :], np.asarray(lengths, np.int32)[:, None] - 1)
        block_rows = np.zeros((num_seqs, block), np.int32)
        token_rows = np.zeros((num_seqs, block), np.int32)
        block_rows[:n] = np.asarray(layout.logit_starts, np.int32)[:, None] + offsets
        token_rows[:n] = np.asarray(layout.token_starts, np.int32)[:, None] + offsets
        drafts = np.zeros((num_seqs, block - 1), np.int32)
        num_drafts = np.zeros(num_seqs, np.int32)
        for i, seq in enumerate(seqs):
            drafts[i, : lengths[i] - 1] = seq.token_ids[1:]
            num_drafts[i] = lengths[i] - 1
        greedy = temperature is None
        if not greedy:
            arrays = sampling.per_row_params(num_seqs, block, temperature, top_p, top_k)
            mode = sampling.sampling_mode(*arrays, self.config.vocab_size)
            greedy = mode == "greedy"
        if greedy:
            mode, arrays, draft_probs, key = "greedy", (None, None, None), None, None
        elif draft_probs is None or key is None or draft_probs.shape[:2] != (num_seqs, block - 1):
            raise BatchError(f"verify with sampling needs draft_probs [{num_seqs}, {block - 1}, V] and a key")
        fn = self._jitted(self._verify_steps, mode, steps.verify_step, norm_block=self._norm_block)
        accepted, bonus, features, self.kv_pool = self._run(
            fn, "verify", batch, mode, num_seqs <= self.tuned_verify_seqs, block_rows, token_rows, drafts, num_drafts,
            *arrays, draft_probs, key, block=block,
        )
        return VerifyOutput(np.asarray(accepted)[:n], np.asarray(bonus)[:n], features)

    def step_read(self) -> None:
        """The caller has read the outputs of its last `sample(wait=False)` step: the seconds since
        it was dispatched (the caller's host work in between included, the same for either
        layout) go to the layer-loop tuner. A step dispatched unwaited and never reported is not
        timed (the next step's dispatch drops it)."""
        if self._unread is not None:
            shape, loop, start = self._unread
            self._tuner.observe(shape, loop, time.perf_counter() - start)
            self._unread = None

    # -- internals --------------------------------------------------------------------------
    def _run(self, fn: Callable, kind: str, batch, mode: str, timed: bool, *args, block: int = 1, wait: bool = True):
        """fn(weights, pool, batch, *args) in the layer loop the tuner picks for this step (none:
        the runner's own); a `timed` step's seconds go to the tuner: now if `wait` (it is waited
        for), else when the caller reports it read the outputs (`step_read`). A shape's first
        timed step compiles every layout (running the step once in each, which writes the same
        K/V twice), so that timing them later compiles nothing mid-serving."""
        self._unread = None
        loop, shape = self._tuner.choose_loop(kind, batch, mode, timed, block) if self._tuner else (self.layer_loop, None)
        weights = {"switch": self._switch_params}
        others = self._tuner.uncompiled(shape, loop) if shape is not None and timed else []
        if others and (room := compiled_memory.program_room()) is not None and room < EXPLORE_ROOM:
            self._tuner.settle(shape, loop)  # near the mapping limit: one program for this shape
            others = []
        for other in others:
            self.kv_pool = fn(weights.get(other, self._step_params), self.kv_pool, batch, *args)[-1]
            self._tuner.observe(shape, other, 0.0)  # its compile: not a timing
        start = time.perf_counter()
        out = fn(weights.get(loop, self._step_params), self.kv_pool, batch, *args)
        if shape is not None and timed and wait:
            jax.block_until_ready(out[0])
            self._tuner.observe(shape, loop, time.perf_counter() - start)
        elif shape is not None and timed:
            self._unread = (shape, loop, start)
        return out

    def _jitted(self, cache: dict, program: str, body: Callable, **static) -> Callable:
        if program not in cache:  # program: a sampling mode, or "<mode> without aux"
            mode = program.removesuffix(" without aux")
            aux_layer_ids = self.aux_layer_ids if mode == program else ()
            body = functools.partial(body, config=self.config, aux_layer_ids=aux_layer_ids, mode=mode, **static)
            cache[program] = self._jit_step(body)
        return cache[program]

    # -- tensor parallelism: where params and the pool live, and the steps' shardings ---------
    def _tp_mesh(self, model_dir, tp_size: int, fuse_projections: bool):
        """None for one device (the single-device path, unchanged); else the checked 1-D mesh."""
        if tp_size == 1:
            return None
        self._tp_config = TargetConfig.from_file(Path(model_dir) / "config.json")
        sharding.check_tp_size(self._tp_config, tp_size)
        if fuse_projections:
            raise sharding.TensorParallelError("fuse_projections cannot be combined with tp_size > 1")
        return sharding.make_mesh(tp_size)

    def _zeros_pool(self, shape: tuple[int, ...], dtype) -> jax.Array:
        if self.mesh is None:
            return jnp.zeros(shape, dtype)
        # Created in place on each device: the whole pool never exists on one device.
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding.kv_pool_sharding(self.mesh))()

    def _jit_step(self, body: Callable, free_outputs: tuple[int, ...] = ()) -> Callable:
        """jit a step whose argument 1 is the pool (donated) and whose last output is the new pool;
        under tp the params and pool come in sharded and XLA partitions the step."""
        if self.dtype == "float32":
            body = _full_precision(body)
        if self.mesh is not None:
            body = sharding.shard_step(body, self.mesh, free_outputs)
        return jax.jit(body, donate_argnums=1)

    def memory_per_device(self) -> dict[str, dict[str, int]]:
        """{"weights" | "kv": {device: bytes}}: what each device holds of the target (all weights)."""
        weights = sharding.bytes_per_device((self.params, self._step_params, self._switch_params))
        return {"weights": weights, "kv": sharding.bytes_per_device(self.kv_pool)}

    def _layout(self, loop: str) -> dict:
        params = model.layer_layout(self.params, loop)
        return model.fuse_projections(params) if self.fuse_projections else params

    def _aux_rows(self, aux: jax.Array, layout) -> AuxRows:
        """The drafter features per sequence, on the host (normed in one program, copied once)."""
        if not self.aux_layer_ids:
            return AuxRows()
        features = np.asarray(self.hidden_state_features(aux))
        spans = tuple(slice(start, start + q) for start, q in zip(layout.token_starts, layout.q_lens))
        return AuxRows([features[span] for span in spans], aux, spans)

    def context_pages(self, start_positions: Sequence[int]) -> int:
        """The page table width (a compiled shape's dimension) of a batch whose sequences start at
        `start_positions`: steps in the same width share compiled programs."""
        return context_pages(max(start_positions, default=0), page_size=self.page_size,
                             pages_per_seq=self.pages_per_seq, min_pages=self._min_pages)

    def _batch(self, seqs: Sequence[SeqInput], fine_tokens: bool = False, query_tiles: bool = True):
        if len(seqs) > self.max_num_seqs:
            raise BatchError(f"{len(seqs)} sequences exceed max_num_seqs {self.max_num_seqs}")
        vocab = self.config.vocab_size
        for i, seq in enumerate(seqs):
            end = seq.start_pos + len(seq.token_ids)
            if end > self.max_model_len:
                raise ContextLengthError(f"sequence {i}: {end} tokens (start_pos {seq.start_pos} + "
                                         f"{len(seq.token_ids)} new) exceed max_model_len {self.max_model_len}")
            ids = np.asarray(seq.token_ids)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                raise BatchError(f"sequence {i}: token ids must be in [0, {vocab}), got {ids.min()}..{ids.max()}")
        # One token row stays one row (a 1-row GEMV is XLA:CPU's fastest matmul); `write_kv` pads its scatter.
        return build_batch(seqs, page_size=self.page_size, pages_per_seq=self.pages_per_seq, min_pages=self._min_pages,
                           fine_tokens=fine_tokens, query_tiles=query_tiles, loop_to_longest=self._loop_to_longest,
                           vocab_major_logits=self._vocab_major_logits, cpu_attention=self.cpu_attention,
                           cpu_matmul=self.cpu_matmul)

    def _cpu_kernel(self, wanted: bool | None, name: str) -> bool:
        """Whether steps run a CPU kernel (`cpu_attention` / `cpu_matmul` of __init__)."""
        if wanted is False:
            return False
        # Under tensor parallel XLA cannot partition a custom call (it would gather the pool and the
        # weights); the matmul kernel reads the out-major weights a CPU runner keeps.
        applies = self._loop_to_longest and self.mesh is None and self.kv_pool.dtype == jnp.float32
        if wanted and not applies:
            raise ValueError(f"{name}=True needs one CPU device and dtype float32")
        if not applies:
            return False
        from jax_backend import cpu_kernels

        if wanted and not cpu_kernels.available():
            raise RuntimeError(f"{name}=True but the CPU kernels could not be built (see the warning above)")
        return cpu_kernels.available()


def _full_precision(body: Callable) -> Callable:
    """`body` with float32 matmuls at full precision. XLA:CPU already computes them so; GPU and TPU
    default to fewer-bit passes (TF32 on an H100), under which a K-row verify block and a 1-row
    decode step round differently and greedy DFLASH parts from greedy NONE (measured on an H100).
    float32 is the exact-output configuration, so it means float32 everywhere."""

    @functools.wraps(body.func if isinstance(body, functools.partial) else body)  # keeps the program's name
    def full(*args):
        with jax.default_matmul_precision("highest"):
            return body(*args)

    return full


_norm_features = jax.jit(steps.norm_features, static_argnums=(2, 3))
