"""The tiny pair: a small target + DFlash drafter generated on this machine (no download).

`python -m sgl_dflash.demo --tiny-pair` and `python -m sgl_dflash.tools.bench_dflash` run on a
pair built here into `cache/tiny_pair/`: a byte-level BPE tokenizer with a chat template trained
with the `tokenizers` library, a tiny Llama target (SmolLM2-style, tied embeddings) trained
on a dozen topics of Python's own documentation (the `pydoc_data` topics shipped with CPython) posed
as chat turns, until it has nearly memorized them, and a DFlash drafter trained with
`sgl_dflash.train` on the target's own greedy answers. A toy: it answers those questions with
(mostly) the documentation text, which makes outputs readable and drafts easy to predict.
Everything is seeded, so a rebuild gives the same pair.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np

from sgl_dflash.tools import CACHE_DIR

PAIR_DIR = CACHE_DIR / "tiny_pair"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_STAMP = "build.json"


@dataclasses.dataclass(frozen=True)
class TinyPairSpec:
    topics: tuple[str, ...] = (
        "for", "while", "if", "return", "assert", "pass", "break", "continue", "lambda", "booleans",
        "class", "with",
    )
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 512
    target_steps: int = 300
    target_batch: int = 8
    target_seq_len: int = 128
    target_lr: float = 3e-3
    answer_tokens: int = 96  # greedy answer length the drafter is trained on
    draft_layers: int = 1
    draft_block_size: int = 16
    draft_steps: int = 600
    draft_lr: float = 3e-3
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class TinyPair:
    target_dir: str
    draft_dir: str


def ensure_tiny_pair(
    cache_dir: str | Path = PAIR_DIR, spec: TinyPairSpec = TinyPairSpec(), progress: bool = True
) -> TinyPair:
    """The tiny pair under `cache_dir`, built first if missing or built with another spec."""
    cache_dir = Path(cache_dir)
    model = TinyPair(str(cache_dir / "target"), str(cache_dir / "drafter"))
    stamp, recipe = cache_dir / _STAMP, json.dumps(dataclasses.asdict(spec), indent=2)
    if stamp.is_file() and stamp.read_text() == recipe:
        return model
    if cache_dir.exists():
        shutil.rmtree(cache_dir)
    build_tiny_pair(model, spec, progress)
    stamp.write_text(recipe)
    return model


def build_tiny_pair(model: TinyPair, spec: TinyPairSpec, progress: bool = True) -> None:
    from sgl_dflash.tools.train import train_drafter

    chats = chat_samples(spec.topics)
    tokenizer = train_tokenizer([c["text"] for c in chats], spec.vocab_size, model.target_dir)
    train_target(model.target_dir, tokenizer, [c["text"] for c in chats], spec, progress)
    prompts = [tokenizer.encode(c["prompt"], add_special_tokens=False) for c in chats]
    sequences, prompt_lens = greedy_answers(model.target_dir, prompts, spec.answer_tokens)
    train_drafter(
        model.target_dir, model.draft_dir, sequences, prompt_lens=prompt_lens, num_layers=spec.draft_layers,
        block_size=spec.draft_block_size, steps=spec.draft_steps, lr=spec.draft_lr, seed=spec.seed,
        mask_token_id=tokenizer.convert_tokens_to_ids("<|mask|>"), progress=progress,
    )


# -- data: Python's documentation as chat turns ---------------------------------------------
def chat_samples(keys: tuple[str, ...], max_answer_chars: int = 700) -> list[dict[str, str]]:
    """One chat turn per documentation chunk: "Explain <topic title>." -> a chunk of its text."""
    from pydoc_data.topics import topics

    samples = []
    for key in keys:
        lines = topics[key].strip().splitlines()
        title = lines[0].strip() if lines else key
        body = "\n".join(lines[2:]).strip() if len(lines) > 2 and set(lines[1]) <= set("*=-") else topics[key]
        for part, chunk in enumerate(_chunks(body, max_answer_chars)):
            question = f"Explain {title}." if part == 0 else f"Tell me more about {title} (part {part + 1})."
            prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
            samples.append({"prompt": prompt, "text": f"{prompt}{chunk}<|im_end|>\n<|endoftext|>"})
    return samples


def _chunks(text: str, size: int) -> list[str]:
    chunks, current = [], ""
    for paragraph in text.split("\n\n"):
        if current and len(current) + len(paragraph) > size:
            chunks.append(current.strip())
            current = ""
        current += paragraph + "\n\n"
    if current.strip():
        chunks.append(current.strip())
    return chunks


# -- tokenizer --------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int, out_dir: str | Path):
    """Byte-level BPE with our special tokens and chat template, saved for AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


# -- target -----------------------------------------------------------------------------------
def train_target(out_dir: str | Path, tokenizer, texts: list[str], spec: TinyPairSpec, progress: bool) -> None:
    """A tiny Llama trained on `texts` (packed, next-token loss), saved in HF format."""
    import torch
    from tqdm import tqdm
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = LlamaForCausalLM(config).train()
    stream = np.concatenate([np.asarray(tokenizer.encode(t, add_special_tokens=False)) for t in texts])
    rng = np.random.default_rng(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.target_lr, weight_decay=0.01)
    bar = tqdm(range(spec.target_steps), desc="train target", disable=not progress)
    for step in bar:
        starts = rng.integers(0, len(stream) - spec.target_seq_len - 1, size=spec.target_batch)
        batch = torch.as_tensor(np.stack([stream[s : s + spec.target_seq_len] for s in starts]))
        lr = spec.target_lr * 0.5 * (1 + math.cos(math.pi * step / spec.target_steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval().save_pretrained(out_dir)
    GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id).save_pretrained(out_dir)


def greedy_answers(target_dir: str, prompts: list[list[int]], max_new_tokens: int):
    """The target's own greedy answers (the drafter learns to predict the target) after each prompt,
    and the prompt lengths (the answers are the supervised part)."""
    from sgl_dflash.entrypoints.engine import Engine

    engine = Engine(model_path=target_dir, skip_tokenizer_init=True, max_running_requests=32,
                    max_total_tokens=32 * 512)
    outputs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens})
    sequences = [p + o["output_ids"] for p, o in zip(prompts, outputs)]
    return sequences, [len(p) for p in prompts]

