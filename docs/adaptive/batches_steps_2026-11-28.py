"""Per-step log of the adaptive engine (predicted vs measured cost and tokens) and NONE's decode steps
during bench_batches' sequence."""
import argparse, json, time, numpy as np
from sgl_dflash.tools import bench_batches as bb
from sgl_dflash.tools.bench_concurrency import take_prompts
from sgl_dflash.tools.train.regenerate import chat_prompt_ids
from sgl_dflash.speculative.cost_model import step_shape
from sgl_dflash import tools
args = argparse.Namespace(model_path=str(tools.REPO_ROOT / "cache/models/SmolLM2-135M-Instruct"),
    draft_model_path=str(tools.REPO_ROOT / "sgl_dflash/assets/smollm2-135m-dflash"), speculative_token_map=None,
    block_sizes=[], adaptive_bound=16)
engines = bb.make_engines(args)
tok = engines["NONE"].tokenizer
worker = engines["adaptive"].scheduler.worker
policy = worker.policy
log, cur = [], {}
choose = policy.choose
def choose_w(slots, modes, drafted, confidence, draft_seconds, block=None):
    k = choose(slots, modes, drafted, confidence, draft_seconds, block)
    limit = policy.num_drafts if block is None else block - 1
    alpha = policy.alphas(slots, modes, confidence)[:, :limit]
    gains = np.where(np.asarray(drafted)[:, None], np.cumprod(alpha, axis=1), 0.0)
    exp = len(slots) + sum(gains[i, :k[i]].sum() for i in range(len(slots)))
    cur.update(k=int(k.sum()), exp_tokens=float(exp), pred_verify=policy.shape_cost(step_shape(k + 1)),
               draft_s=draft_seconds, plain_pred=policy.step_cost(np.ones(len(slots), np.int64)), block=block)
    return k
policy.choose = choose_w
fd = worker.forward_decode
def fd_w(batch):
    cur.clear(); cur["plain_pred"] = policy.step_cost(np.ones(len(batch.slots), np.int64))
    t = time.perf_counter(); r = fd(batch); dt = time.perf_counter() - t
    log.append(dict(engine="adaptive", n=len(batch.slots), seconds=dt, tokens=int(r.accept_lens.sum()) + len(batch.slots),
                    drafted=int((r.verify_lens > 0).sum()), t=time.perf_counter(), **cur))
    return r
worker.forward_decode = fd_w
nw = engines["NONE"].scheduler.worker
nfd = nw.forward_decode
def nfd_w(batch):
    t = time.perf_counter(); r = nfd(batch); dt = time.perf_counter() - t
    log.append(dict(engine="NONE", n=len(batch.slots), seconds=dt, t=time.perf_counter())); return r
nw.forward_decode = nfd_w
for set_name in ["gsm8k", "mt-bench"]:
    texts, _ = take_prompts(set_name, 80)
    prompts = [chat_prompt_ids(tok, p) for p in texts]
    marker = len(log)
    rows = bb.run_batches(engines, prompts, [8, 32], 2, 128)
    for line in bb.format_rows(set_name, rows): print(line, flush=True)
    for e in log[marker:]: e["set"] = set_name
json.dump(log, open("/tmp/probe/diag2.json", "w"))
