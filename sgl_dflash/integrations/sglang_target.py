"""SGLang's target worker, running our JAX target: `JaxTpModelWorker` replaces SGLang's
`sglang.srt.managers.tp_worker.TpModelWorker` (through SGLang's HookRegistry, class REPLACE, in
sglang_plugin.register) when the dflash_jax platform is active.

SGLang has no platform hook for the target worker; its in-tree MLX backend is the precedent
(`hardware_backend/mlx/tp_worker.py` + `model_runner_stub.py`): a TpModelWorker subclass whose
model runner is a stub (no torch weights, a zero-byte torch KV pool) so that SGLang keeps its
request bookkeeping (`ReqToTokenPool`, the token-slot allocator, the scheduler) while the forward
runs elsewhere. Here it runs in `TargetWorker` (NONE) or `DFlashWorker` (DFLASH; the SGLang-side
spec worker in sglang_dflash.py drives it), built once in this worker: one JAX target, one KV pool.

SGLang internals this module touches (sglang 0.5.23), and why:
- `TpModelWorker._init_model_runner` (overridden): builds our JAX worker and the stub runner;
- `TpModelWorker.forward_batch_generation` (overridden): a `ScheduleBatch` in, SGLang's
  `GenerationBatchResult(next_token_ids=...)` out, as the MLX worker does;
- `ModelRunner` (subclassed as `JaxModelRunnerStub`): `initialize`, `load_model`,
  `alloc_memory_pool`, `init_attention_backends` overridden; `ReqToTokenPool`,
  `TokenToKVPoolAllocator`, `KVCache` (a dummy one) built like the MLX stub does.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from sglang.srt.configs.shared_experts import SharedExpertsConfig
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import KVCache, ReqToTokenPool
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo

from sgl_dflash.integrations.sglang_args import dflash_server_args
from sgl_dflash.integrations.sglang_batch import decode_batch, extend_batch

logger = logging.getLogger(__name__)


class _NoKVCache(KVCache):
    """The torch KV cache SGLang's allocator wants to see; the K/V live in our JAX pool."""

    def __init__(self, size: int, dtype: torch.dtype):
        # KVCache.__init__ would set up memory savers and custom pools (device APIs): skipped.
        self.size, self.page_size, self.dtype, self.store_dtype = size, 1, dtype, dtype
        self.device = "cpu"
        self.layer_num = self.start_layer = self.end_layer = 0
        self.mem_usage = 0
        self.cpu_offloading_chunk_size = 8192
        self.layer_transfer_counter = None
        self.enable_custom_mem_pool, self.custom_mem_pool = False, None

    def _no_buffer(self, *args: Any, **kwargs: Any):
        raise RuntimeError("the dflash_jax platform keeps K/V in its JAX pool, not in torch buffers")

    get_key_buffer = get_value_buffer = get_kv_buffer = set_kv_buffer = _no_buffer

    def get_kv_size_bytes(self):
        return 0, 0


class _NoModel:
    """What ModelRunner inspects on `self.model` (forward's signature, shared_experts_config)."""

    shared_experts_config = SharedExpertsConfig()

    @staticmethod
    def forward():
        pass


class JaxModelRunnerStub(ModelRunner):
    """SGLang's ModelRunner minus torch: pools sized by our JAX worker, no weights, no graphs."""

    canary_manager = None
    prefill_aware_swa = False

    def __init__(self, *args: Any, pool_size: int, max_running_requests: int, **kwargs: Any):
        self._pool_size, self._max_running_requests = pool_size, max_running_requests
        super().__init__(*args, **kwargs)

    @property
    def preloaded_weights_bytes(self) -> int:
        return 0

    def load_model(self):
        self.model = _NoModel()
        self.sliding_window_size = None
        self.dtype = self.model_config.dtype
        self.weight_load_mem_usage = 0

    def initialize(self):
        from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

        self.memory_saver_adapter = TorchMemorySaverAdapter.create(enable=False)
        self.sampler = None
        self.load_model()
        layers = self.model_config.num_hidden_layers
        self.layer_info = ModelLayerInfo(start_layer=0, end_layer=layers, num_effective_layers=layers)
        self.kv_cache_dtype = self.dtype
        self.max_total_num_tokens = self._pool_size
        self.max_running_requests = self._max_running_requests
        self.is_hybrid_swa = False
        # Rows hold a request's slots: context plus the decode reservation past it (a DFLASH block).
        self.req_to_token_pool = ReqToTokenPool(
            size=self.max_running_requests,
            max_context_len=self.model_config.context_len + get_req_to_token_extra_context_len(),
            device="cpu",
            enable_memory_saver=False,
        )
        self.token_to_kv_pool = _NoKVCache(self.max_total_num_tokens, self.kv_cache_dtype)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(
            size=self.max_total_num_tokens, dtype=self.kv_cache_dtype, device="cpu",
            kvcache=self.token_to_kv_pool, need_sort=False,
        )
        self.decode_cuda_graph_runner = None
        self.attn_backend = None
        self.init_ngram_embedding_manager()

    @property
    def logical_max_total_num_tokens(self) -> int:
        return self.max_total_num_tokens

    def alloc_memory_pool(self, memory_pool_config=None, *, draft_parallel_layout=None):
        """The pools were built in initialize(), sized by our JAX KV pool."""

    def init_attention_backends(self):
        self.attn_backend = None


class JaxTpModelWorker(TpModelWorker):
    """SGLang's target worker whose forward is our JAX `TargetWorker` (or `DFlashWorker`'s)."""

    def _init_model_runner(self):
        if self.is_draft_worker:  # not ours: our DFLASH drafter is not an SGLang draft model
            return super()._init_model_runner()
        from sgl_dflash import compilation_cache
        from sgl_dflash.model_executor.target_worker import TargetWorker
        from sgl_dflash.speculative.dflash_worker import DFlashWorker

        args = dflash_server_args(self.server_args, context_length=self.model_config.context_len)
        compilation_cache.enable(args.compilation_cache_dir)  # SGLang has no flag: $SGL_DFLASH_COMPILATION_CACHE_DIR
        # One JAX target for both roles: with DFLASH it records the drafter's aux layers.
        self.engine = DFlashWorker(args) if args.speculative_algorithm == "DFLASH" else TargetWorker(args)
        self.tokens_per_step = getattr(self.engine, "tokens_per_step", 1)
        self.vocab_size = self.engine.vocab_size
        logger.info("dflash_jax: JAX %s on %s, KV pool %d tokens (page size 1), %d running requests",
                    type(self.engine).__name__, args.model_path, args.max_total_tokens, args.max_running_requests)
        self._model_runner = JaxModelRunnerStub(
            model_config=self.model_config, mem_fraction_static=0.0, gpu_id=self.gpu_id,
            nccl_port=self.nccl_port, server_args=self.server_args, is_draft_worker=False,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            memory_pool_config=self.memory_pool_config,
            pool_size=args.max_total_tokens, max_running_requests=args.max_running_requests,
        )

    def get_pad_input_ids_func(self):
        return None

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.model_runner.req_to_token_pool.req_to_token

    def forward_batch_generation(self, batch: Optional[Any], forward_batch: Any = None, *args: Any,
                                 **kwargs: Any) -> GenerationBatchResult:
        """Plain autoregressive steps (the NONE algorithm); DFLASH steps go through the spec worker."""
        if batch is None or self.is_draft_worker:
            return super().forward_batch_generation(batch, forward_batch, *args, **kwargs)
        target = getattr(self.engine, "target_worker", self.engine)
        if batch.forward_mode.is_idle() or not batch.reqs:
            tokens = torch.zeros(0, dtype=torch.long)
        elif batch.forward_mode.is_extend():
            result, _ = target.forward_extend(extend_batch(batch, self.req_to_token, self.vocab_size))
            tokens = torch.from_numpy(result.next_token_ids[:, 0].astype("int64"))
        elif batch.forward_mode.is_decode():
            # SGLang's decode preparation counted the pending token in: it runs at seq_len - 1.
            prefix = [int(req.kv.kv_committed_len) - 1 for req in batch.reqs]
            result = target.forward_decode(decode_batch(batch, self.req_to_token, self.vocab_size, prefix, 1))
            tokens = torch.from_numpy(result.next_token_ids[:, 0].astype("int64"))
        else:
            raise NotImplementedError(f"the dflash_jax platform does not run forward mode {batch.forward_mode}")
        return GenerationBatchResult(logits_output=LogitsProcessorOutput(next_token_logits=None),
                                     next_token_ids=tokens, can_run_cuda_graph=False)
