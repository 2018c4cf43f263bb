import argparse, json, statistics
from sgl_dflash.tools import bench_concurrency as bc
from sgl_dflash.tools.train.regenerate import chat_prompt_ids
from sgl_dflash import tools
args = argparse.Namespace(model_path=str(tools.REPO_ROOT / "cache/models/SmolLM2-135M-Instruct"),
    draft_model_path=str(tools.REPO_ROOT / "sgl_dflash/assets/smollm2-135m-dflash"), speculative_token_map=None,
    block_sizes=[], adaptive_bound=16)
engines = bc.make_engines(args)
tok = engines["NONE"].tokenizer
prompts = [chat_prompt_ids(tok, p) for p in bc.prompt_sets(["mt-bench"], 64)["mt-bench"]]
res = {}
for rep in range(3):
    row = bc.serve(engines, prompts, 32, 64)
    for name, r in row.items():
        steps = r["prefill_steps"]
        n = [s[0] for s in steps]
        print(rep, name, "steady %.1f" % r["steady_tokens_per_s"], "prefill s %.2f" % r["prefill_seconds"],
              "decode %d tok in %.2f s" % (r["full_decode_tokens"], r["full_decode_seconds"]),
              "compiling", r["compiling_steps"], "%.1f s" % r["compile_seconds"],
              "| prefill steps", len(steps), "prompts", sum(n), "tokens", sum(s[1] for s in steps),
              "ms/token %.2f" % (1e3 * r["prefill_seconds"] / max(1, sum(s[1] for s in steps))), flush=True)
        print("   sizes", n, flush=True)
        res[f"{rep}/{name}"] = {k: v for k, v in r.items() if k != "outputs"}
    print("outputs equal", row["NONE"]["outputs"] == row["adaptive"]["outputs"], flush=True)
json.dump(res, open("/tmp/probe/closed_prefill.json", "w"), indent=1)
