"""Engine A/B of the drafter's head-major cache and keys-first CPU attention (docs/performance.md
section 40): a DFLASH engine (block 8, the user's defaults) serves the same greedy prompts at
batch 1 from two checkouts, in alternating subprocesses; each prompt is a long document (chat
questions joined) and a question, so the drafter reads a long context window.

    python docs/performance/drafter_head_major_ab_2026-12-05.py BASE_CHECKOUT OUT.json [TOKENS ...]

TOKENS: the prompts' approximate lengths (default 300 1500 3000). Prints and writes per checkout
and length the DFLASH decode step, its draft and verify parts (ms) and the outputs' equality."""
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import json, sys
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.tools.bench_dflash import timed_generate
from sgl_dflash.tools.bench_engines import resolve_engine_args
from sgl_dflash.tools.bench_concurrency import take_prompts
from sgl_dflash.tools import CACHE_DIR
from types import SimpleNamespace
args = SimpleNamespace(model_path=None, draft_model_path=None, compilation_cache=CACHE_DIR / "jax_compilation_cache")
resolve_engine_args(args)
engine = Engine(model_path=args.model_path, random_seed=0, speculative_algorithm="DFLASH",
                speculative_draft_model_path=args.draft_model_path, speculative_num_draft_tokens=8)
texts, _ = take_prompts("mt-bench", 80)
tokenizer = engine.tokenizer
generate = engine.generate  # every answer runs its full length (these prompts may end early)
engine.generate = lambda prompt, sampling_params: generate(prompt=prompt, sampling_params={**sampling_params, "ignore_eos": True})
results = {}
for target in map(int, sys.argv[1:]):
    prompts = []
    for start in (0, 40):  # two documents of about `target` tokens, then a question about them
        doc, i = [], start
        while len(tokenizer.encode("\n\n".join(doc))) < target - 40:
            doc.append(texts[i % len(texts)]); i += 1
        prompts.append("\n\n".join(doc) + "\n\nIn one paragraph: what do the requests above have in common?")
    timed_generate(engine, prompts[:1], 1, 16)  # warm-up: compiles this context's programs
    r = timed_generate(engine, prompts, 1, 96)
    results[target] = {k: r[k] for k in ("decode_step_ms", "step_ms", "tau", "context", "output_ids", "compile_s")}
print("RESULT " + json.dumps(results))
'''


def run(root: str, lengths: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, *lengths], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root})
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(line[-1][7:])


def main() -> None:
    base, path, lengths = sys.argv[1], Path(sys.argv[2]), sys.argv[3:] or ["300", "1500", "3000"]
    here = str(Path(__file__).resolve().parents[2])
    runs = {"base": [], "new": []}
    for round_ in range(2):
        for name, root in ([("base", base), ("new", here)] if round_ == 0 else [("new", here), ("base", base)]):
            runs[name].append(run(root, lengths))
            for length, r in runs[name][-1].items():
                print(f"{name} ~{length} tokens (context {r['context']:.0f}): step {r['decode_step_ms']:.2f} ms, "
                      f"draft {r['step_ms']['draft']:.2f}, verify {r['step_ms']['verify']:.2f}, tau {r['tau']:.2f}, "
                      f"compile {r['compile_s']:.1f} s", flush=True)
    same = all(r[length]["output_ids"] == runs["base"][0][length]["output_ids"]
               for r in runs["base"] + runs["new"] for length in r)
    print("outputs identical across checkouts and rounds:", same)
    path.write_text(json.dumps({"lengths": lengths, "runs": runs, "outputs_identical": same}, indent=1))


if __name__ == "__main__":
    main()
