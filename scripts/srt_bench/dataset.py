"""The `random` dataset: prompts of chosen token lengths made from the model's own tokenizer, offline.

Random token ids decoded to text do not always re-encode to the same number of tokens (neighbouring pieces
merge), so each prompt is re-encoded and trimmed or topped up until its length is the one asked for. With
a chat endpoint the chat template's own tokens count towards the prompt, so the user text is shortened by
the template's overhead: `--random-input-len 256` means 256 tokens reach the model either way.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# Re-encode/trim rounds before accepting a prompt whose length is off by a token or two.
MAX_LENGTH_FIX_ROUNDS = 8


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int
    # a LoRA adapter's name (OpenAI's `model`, /generate's `lora_path`); keyword-only, so subclasses' own
    # positional fields keep their places
    lora: str | None = field(default=None, kw_only=True)


def load_tokenizer(path: str | None):
    """The tokenizer of `path` (an HF directory) or of the embedded model; never downloads."""
    from transformers import AutoTokenizer

    if path is None:
        from srt.model_source import resolve_model_dir

        path = resolve_model_dir(None)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def sample_lengths(rng: random.Random, num: int, full_len: int, range_ratio: float) -> list[int]:
    """Uniform lengths in [max(1, full_len * range_ratio), full_len], as SGLang draws them; ratio 1 = fixed."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    low = max(int(full_len * range_ratio), 1)
    return [rng.randint(low, full_len) for _ in range(num)]


def _ordinary_token_ids(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def _chat_overhead(tokenizer) -> int:
    """Tokens the chat template adds around one user message."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return len(ids)


def _text_of_length(tokenizer, rng: random.Random, vocab: list[int], target: int) -> str:
    ids = [rng.choice(vocab) for _ in range(target)]
    text = tokenizer.decode(ids)
    for _ in range(MAX_LENGTH_FIX_ROUNDS):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target:
            break
        if len(ids) > target:
            ids = ids[:target]
        else:
            ids = ids + [rng.choice(vocab) for _ in range(target - len(ids))]
        text = tokenizer.decode(ids)
    return text


def prompt_token_count(tokenizer, prompt: str, chat: bool) -> int:
    if chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return len(ids)
    return len(tokenizer.encode(prompt, add_special_tokens=False))


def random_requests(
    tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    chat: bool,
) -> list[BenchRequest]:
    """`num_prompts` requests with random prompts; the same seed gives the same prompts and lengths."""
    rng = random.Random(seed)
    input_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    output_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    vocab = _ordinary_token_ids(tokenizer)
    overhead = _chat_overhead(tokenizer) if chat else 0
    requests = []
    for in_len, out_len in zip(input_lens, output_lens, strict=True):
        text = _text_of_length(tokenizer, rng, vocab, max(in_len - overhead, 1))
        requests.append(BenchRequest(text, prompt_token_count(tokenizer, text, chat), out_len))
    logger.info(
        "random dataset: %d prompts, mean input %.1f tokens, mean output %.1f tokens",
        num_prompts,
        sum(r.prompt_len for r in requests) / max(num_prompts, 1),
        sum(r.output_len for r in requests) / max(num_prompts, 1),
    )
    return requests
