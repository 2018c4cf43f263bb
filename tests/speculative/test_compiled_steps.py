"""What XLA compiles for a step: no while loop without a known trip count (no host round trip
inside a step on GPU), and no whole-cache copies in the drafter.

On CPU the target's attention loops only over the chunks its longest prefix needs, a trip count
read on the device (free there: `jax_backend.paged_attention`); on accelerators it visits every
chunk of the window. The trip-count check compiles the accelerator configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from jax_backend.hlo_check import optimized_modules, unbounded_while_loops, while_loops

REPO = Path(__file__).resolve().parents[2]

# Prefill, decode and verify past one attention chunk (256 tokens), greedy and sampled (top-p:
# the sort path), for NONE and DFLASH: every program an Engine compiles for these.
ENGINE_RUN = textwrap.dedent(
    """
    import sys
    import numpy as np
    from jax_backend.runner import TargetRunner
    from sgl_dflash.entrypoints.engine import Engine

    cpu_init = TargetRunner.__init__
    def accelerator_init(self, *args, **kwargs):  # attention over every chunk, as on GPU/TPU
        cpu_init(self, *args, **kwargs)
        self._loop_to_longest = False
    TargetRunner.__init__ = accelerator_init
    target, draft = sys.argv[1], sys.argv[2]
    common = dict(model_path=target, skip_tokenizer_init=True, max_total_tokens=2048,
                  max_running_requests=4, context_length=640, random_seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 16, n).tolist() for n in (300, 20)]
    for extra in ({}, dict(speculative_algorithm="DFLASH", speculative_draft_model_path=draft,
                           speculative_num_draft_tokens=4)):
        engine = Engine(**common, **extra)
        for params in ({"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9}):
            engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 12, "ignore_eos": True})
    """
)


def test_engine_programs_have_no_while_loop_with_unknown_trip_count(tmp_path, spec_target_dir, random_draft_dir):
    dump = tmp_path / "xla_dump"
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_cpu_multi_thread_eigen=false")
    subprocess.run([sys.executable, "-c", ENGINE_RUN, spec_target_dir, random_draft_dir], env=env, check=True,
                   cwd=tmp_path, timeout=900)
    modules = optimized_modules(dump)
    steps = {name: text for name, text in modules.items() if any(
        f"jit_{step}." in name for step in ("step", "sample_step", "verify_step"))}
    assert len(steps) >= 3, sorted(modules)  # prefill, decode and verify of the target at least
    # The long prompt's decode/verify attends over 2 chunks: a loop, with a static trip count.
    assert any(len(while_loops(text)) >= 2 for text in steps.values())
    unbounded = {name: unbounded_while_loops(text) for name, text in modules.items()}
    assert not {name: loops for name, loops in unbounded.items() if loops}

    # The drafter's KV caches [max_running_requests, kv_heads, context + block + 1, head_dim] are
    # updated in place: no program copies them (at the default context that copy cost ~0.5 s).
    draft = json.loads((Path(random_draft_dir) / "config.json").read_text())
    cache = f"f32[4,{draft['num_key_value_heads']},{640 + 4 + 1},{draft['head_dim']}]"
    assert any(cache in text for text in modules.values())
    copies = [line.strip()[:120] for text in modules.values() for line in text.splitlines()
              if f"= {cache}" in line and " copy(" in line]
    assert not copies


def test_hlo_check_reads_known_trip_counts():
    known = '%while.1 = (s32[]) while(%t), condition=%c, body=%b, backend_config={"known_trip_count":{"n":"30"}}'
    unknown = "  %while.2 = (s32[], f32[4]{0}) while(%tuple.3), condition=%c2, body=%b2"
    assert while_loops(known + "\n" + unknown) == [("while.1", True), ("while.2", False)]
    assert unbounded_while_loops(unknown) == ["while.2"]


def test_a_new_prompt_length_compiles_nothing_once_its_buckets_ran(dflash_engine):
    """Serving a prompt of a length not seen before, inside token and context buckets already
    compiled, runs only compiled programs (prefill, the drafter's context and features included):
    a compile in the middle of serving stalls every running request. The drafter's features used
    to be sliced per sequence on the device, one small program per prompt length."""
    import jax
    import numpy as np

    engine = dflash_engine(4)
    rng = np.random.default_rng(3)
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    engine.generate(input_ids=[rng.integers(0, 16, 9).tolist(), rng.integers(0, 16, 10).tolist()],
                    sampling_params=params)
    traced: list[str] = []

    def on_event(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traced.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        for length in (11, 12, 13):
            engine.generate(input_ids=[rng.integers(0, 16, length).tolist(), rng.integers(0, 16, length - 2).tolist()],
                            sampling_params=params)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert traced == []
