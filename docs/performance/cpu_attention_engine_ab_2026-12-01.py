"""A/B in one process: NONE engines (engine defaults: context 8192, 32 running requests) on the
real SmolLM2 with the CPU attention kernel (the default) and with XLA's attention, greedy, the
engines taking turns pass by pass; decode tokens/s and ms per decode step at batch 1 and 32.

    python docs/performance/cpu_attention_engine_ab_2026-12-01.py [passes] [max_new_tokens]

Writes docs/performance/cpu_attention_engine_ab_2026-12-01.json."""

import json
import statistics
import sys
from pathlib import Path

from jax_backend import runner as runner_module
from sgl_dflash import Engine
from sgl_dflash.tools import datasets
from sgl_dflash.tools.bench_dflash import timed_generate
from sgl_dflash.tools.bench_roofline import measure_machine
from sgl_dflash.tools.demo import chat_prompts

MODEL = "cache/models/SmolLM2-135M-Instruct"
passes = int(sys.argv[1]) if len(sys.argv) > 1 else 3
max_new = int(sys.argv[2]) if len(sys.argv) > 2 else 64

engines = {"kernel": Engine(model_path=MODEL, random_seed=0)}
chosen = runner_module.TargetRunner._cpu_attention
runner_module.TargetRunner._cpu_attention = lambda self, wanted: False  # this engine: XLA's attention
try:
    engines["xla"] = Engine(model_path=MODEL, random_seed=0)
finally:
    runner_module.TargetRunner._cpu_attention = chosen
assert engines["kernel"].scheduler.worker.runner.cpu_attention and not engines["xla"].scheduler.worker.runner.cpu_attention

questions = [r["prompt"] for r in datasets.load_benchmark("mt-bench")][:32]
prompts = chat_prompts(engines["kernel"].tokenizer, questions)
machine = measure_machine(False)
rows = []
for batch in (1, 32):
    work = prompts[:4] if batch == 1 else prompts[:32]
    for name in engines:  # warm-up pass: compiles
        timed_generate(engines[name], work, batch, max_new)
    runs = {name: [] for name in engines}
    for p in range(passes):
        for name in (list(engines) if p % 2 == 0 else list(engines)[::-1]):
            runs[name].append(timed_generate(engines[name], work, batch, max_new))
    row = {"batch": batch, "prompts": len(work)}
    for name, rs in runs.items():
        row[name] = {"decode_step_ms": statistics.median(r["decode_step_ms"] for r in rs),
                     "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in rs),
                     "context": rs[0]["context"]}
    row["step_ratio_kernel_over_xla"] = row["kernel"]["decode_step_ms"] / row["xla"]["decode_step_ms"]
    row["outputs_equal"] = all(a["output_ids"] == b["output_ids"] for a, b in zip(runs["kernel"], runs["xla"]))
    rows.append(row)
    print(json.dumps(row), flush=True)
out = {"machine": machine, "passes": passes, "max_new_tokens": max_new, "rows": rows}
Path(__file__).with_suffix(".json").write_text(json.dumps(out, indent=2))
