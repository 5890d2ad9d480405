"""The random dataset: lengths drawn like SGLang's, prompts that really have the asked token length."""

import random

import pytest

from srt_bench.dataset import random_requests, sample_lengths


def test_range_ratio_one_gives_fixed_lengths():
    assert sample_lengths(random.Random(0), 5, 256, 1.0) == [256] * 5


def test_lengths_stay_within_ratio_bounds():
    lengths = sample_lengths(random.Random(0), 500, 100, 0.5)
    assert min(lengths) >= 50 and max(lengths) <= 100
    assert len(set(lengths)) > 10


def test_ratio_zero_still_asks_for_at_least_one_token():
    assert min(sample_lengths(random.Random(0), 500, 4, 0.0)) == 1


def test_ratio_outside_zero_one_is_rejected():
    with pytest.raises(ValueError):
        sample_lengths(random.Random(0), 1, 4, 1.5)


@pytest.fixture(scope="module")
def tokenizer():
    from srt_bench.dataset import load_tokenizer

    return load_tokenizer(None)


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True])
def test_prompts_have_the_asked_token_length_including_the_chat_template(tokenizer, chat):
    reqs = random_requests(tokenizer, 6, 256, 64, 1.0, seed=5, chat=chat)
    for req in reqs:
        assert req.output_len == 64
        assert req.prompt_len == 256
        if chat:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": req.prompt}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        else:
            ids = tokenizer.encode(req.prompt, add_special_tokens=False)
        assert len(ids) == 256


@pytest.mark.slow
def test_same_seed_same_prompts_other_seed_other_prompts(tokenizer):
    a = random_requests(tokenizer, 3, 32, 8, 0.5, seed=1, chat=False)
    b = random_requests(tokenizer, 3, 32, 8, 0.5, seed=1, chat=False)
    c = random_requests(tokenizer, 3, 32, 8, 0.5, seed=2, chat=False)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]
