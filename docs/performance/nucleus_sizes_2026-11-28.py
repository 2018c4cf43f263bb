import torch, numpy as np, json
from transformers import AutoTokenizer, AutoModelForCausalLM
from sgl_dflash.tools.bench_concurrency import take_prompts
d = "cache/models/SmolLM2-135M-Instruct"
tok = AutoTokenizer.from_pretrained(d); model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
sizes = []
for name in ("mt-bench", "gsm8k"):
    texts, _ = take_prompts(name, 4)
    for t in texts:
        from sgl_dflash.tools.train.regenerate import chat_prompt_ids; ids = torch.tensor([chat_prompt_ids(tok, t)])
        torch.manual_seed(0)
        out = model.generate(ids, do_sample=True, temperature=0.8, top_p=1.0, max_new_tokens=96, output_logits=True, return_dict_in_generate=True)
        for l in out.logits:
            p = torch.softmax(l[0].float() / 0.8, -1).sort(descending=True).values
            sizes.append(int((p.cumsum(0) - p < 0.95).sum()))
s = np.array(sizes)
print(len(s), "median", np.median(s), "p90", np.percentile(s, 90), "p99", np.percentile(s, 99), "max", s.max(), "frac>1024", (s > 1024).mean())
for b in (32, 64): print("P(all of", b, "rows fit) ~", (1 - (s > 1024).mean()) ** b)
json.dump(sizes, open("/tmp/nucleus_sizes.json", "w"))
