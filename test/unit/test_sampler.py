"""Specification of sampling: greedy, the top-k/top-p/min-p masks, seeds, penalties, min_new_tokens
and log-probabilities."""

import math

import pytest
import torch

from srt.sampling import token_filters as token_filters_module
from srt.sampling.penalties import apply_min_new_tokens, apply_penalties
from srt.sampling.sampler import Sampler, make_generator
from srt.sampling.sampling_batch import one_off_batch
from srt.sampling.sampling_params import SamplingParams
from srt.sampling.token_filters import filtered_probs, greedy_ids, sample_from_probs

VOCAB = 50
EOS = 2


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(VOCAB, eos_token_ids=[EOS])


def run(sampler, logits, params, outputs=None, generators=None, inputs=None):
    bs = len(params)
    batch = one_off_batch(
        params,
        inputs or [[] for _ in range(bs)],
        outputs or [[] for _ in range(bs)],
        generators or [None] * bs,
        VOCAB,
        [EOS],
    )
    return sampler.sample(logits, batch)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


# ---- greedy ----------------------------------------------------------------------------------------------


def test_greedy_is_argmax(sampler):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    out = run(sampler, logits, [SamplingParams(temperature=0.0)] * 2 + [SamplingParams(top_k=1)] * 2)
    assert out.next_token_ids == logits.argmax(-1).tolist()
    assert out.token_logprobs is None and out.top_logprobs is None


def test_greedy_rows_stay_argmax_next_to_sampled_rows(sampler):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
    ]
    out = run(sampler, logits, params)
    assert out.next_token_ids[0] == logits[0].argmax().item()
    assert out.next_token_ids[2] == logits[2].argmax().item()


# ---- masks ---------------------------------------------------------------------------------------------

PROBS = [0.5, 0.3, 0.15, 0.05]


def kept(probs: torch.Tensor) -> list[int]:
    return torch.nonzero(probs[0] > 0).flatten().tolist()


@pytest.mark.parametrize("k, expected", [(1, [0]), (2, [0, 1]), (3, [0, 1, 2]), (-1, [0, 1, 2, 3])])
def test_top_k_keeps_exactly_the_k_best(k, expected):
    assert kept(filtered_probs(logits_of(PROBS), top_k=[k], top_p=[1.0], min_p=[0.0])) == expected


@pytest.mark.parametrize(
    "p, expected",
    [(0.4, [0]), (0.5, [0]), (0.7, [0, 1]), (0.9, [0, 1, 2]), (0.99, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, expected):
    assert kept(filtered_probs(logits_of(PROBS), top_k=[-1], top_p=[p], min_p=[0.0])) == expected


@pytest.mark.parametrize("m, expected", [(0.0, [0, 1, 2, 3]), (0.2, [0, 1, 2]), (0.5, [0, 1]), (0.9, [0])])
def test_min_p_drops_tokens_below_a_fraction_of_the_best(m, expected):
    assert kept(filtered_probs(logits_of(PROBS), top_k=[-1], top_p=[1.0], min_p=[m])) == expected


def test_top_p_applies_to_the_top_k_renormalized_distribution():
    # after top_k=2 the distribution is 0.625 / 0.375, so top_p=0.6 keeps only the best
    assert kept(filtered_probs(logits_of(PROBS), top_k=[2], top_p=[0.6], min_p=[0.0])) == [0]


def test_masks_are_per_row():
    logits = torch.cat([logits_of(PROBS), logits_of(PROBS)])
    probs = filtered_probs(logits, top_k=[1, -1], top_p=[1.0, 1.0], min_p=[0.0, 0.0])
    assert (probs[0] > 0).sum() == 1 and (probs[1] > 0).sum() == 4


def test_top_p_widens_its_search_when_the_first_candidates_fall_short(monkeypatch):
    monkeypatch.setattr(token_filters_module, "TOP_P_CANDIDATES", (1, 2))
    logits = torch.cat([logits_of(PROBS)] * 3)
    probs = filtered_probs(logits, top_k=[-1] * 3, top_p=[0.4, 0.7, 0.9], min_p=[0.0] * 3)
    assert [torch.nonzero(row > 0).flatten().tolist() for row in probs] == [[0], [0, 1], [0, 1, 2]]


def test_top_p_leaves_rows_without_it_untouched():
    logits = torch.cat([logits_of(PROBS), logits_of(PROBS)])
    probs = filtered_probs(logits, top_k=[-1, -1], top_p=[1.0, 0.5], min_p=[0.0, 0.0])
    assert torch.allclose(probs[0], torch.tensor(PROBS))
    assert (probs[1] > 0).sum() == 1


def test_inverse_cdf_never_lands_on_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    chosen = sample_from_probs(probs, torch.tensor([0.0, 0.49, 0.51, 1.0]))
    assert chosen.tolist() == [1, 1, 3, 1]


def test_sampled_tokens_respect_masks_and_follow_the_distribution(sampler):
    draws = 4000
    logits = logits_of(PROBS).expand(draws, -1)
    gen = torch.Generator().manual_seed(7)
    out = run(sampler, logits, [SamplingParams(top_k=3)] * draws, generators=[gen] * draws)
    counts = torch.bincount(torch.tensor(out.next_token_ids), minlength=4).tolist()
    assert counts[3] == 0, "top_k=3 excludes the 4th token"
    total = sum(PROBS[:3])
    for token in range(3):
        assert abs(counts[token] / draws - PROBS[token] / total) < 0.03


def test_temperature_sharpens_the_distribution(sampler):
    draws = 2000
    logits = logits_of(PROBS).expand(draws, -1)
    gen = torch.Generator().manual_seed(3)
    out = run(sampler, logits, [SamplingParams(temperature=0.25)] * draws, generators=[gen] * draws)
    share_best = out.next_token_ids.count(0) / draws
    expected = 0.5**4 / sum(p**4 for p in PROBS)
    assert abs(share_best - expected) < 0.03


# ---- seeds ---------------------------------------------------------------------------------------------


def generate(sampler, row_logits, seed, companions, steps=8):
    """Sample `steps` tokens for a seeded request whose batch also holds `companions` other rows."""
    default = torch.Generator().manual_seed(99)
    gen = make_generator(seed, default)
    others = [make_generator(s, default) for s in companions]
    tokens = []
    for step in range(steps):
        noise = torch.randn(len(companions), VOCAB, generator=torch.Generator().manual_seed(step))
        logits = torch.cat([noise[:1], row_logits[step : step + 1], noise[1:]])
        gens = others[:1] + [gen] + others[1:]
        params = [SamplingParams(seed=s) for s in companions[:1]] + [SamplingParams(seed=seed)]
        params += [SamplingParams(seed=s) for s in companions[1:]]
        tokens.append(run(sampler, logits, params, generators=gens).next_token_ids[1])
    return tokens


def test_same_seed_gives_same_tokens_whatever_else_is_in_the_batch(sampler):
    row_logits = torch.zeros(8, VOCAB)  # uniform: the seed alone decides
    alone = generate(sampler, row_logits, seed=42, companions=[None])
    assert generate(sampler, row_logits, seed=42, companions=[None, None, 5]) == alone
    assert generate(sampler, row_logits, seed=42, companions=[7, None]) == alone
    assert generate(sampler, row_logits, seed=43, companions=[None]) != alone


def test_make_generator_returns_the_default_without_a_seed():
    default = torch.Generator()
    assert make_generator(None, default) is default
    a, b = make_generator(5, default), make_generator(5, default)
    assert a is not b and torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


# ---- penalties -----------------------------------------------------------------------------------------


def penalize(params, logits, inputs, outputs):
    logits = logits.clone()
    apply_penalties(logits, [params], [inputs], [outputs])
    return logits[0]


def test_frequency_penalty_scales_with_the_output_count():
    out = penalize(SamplingParams(frequency_penalty=0.5), torch.zeros(1, 10), [1, 1], [5, 5, 5, 7])
    assert out[5].item() == pytest.approx(-1.5)
    assert out[7].item() == pytest.approx(-0.5)
    assert out[1].item() == 0.0, "prompt tokens are not counted"
    assert out[[0, 2, 3, 4, 6, 8, 9]].abs().sum() == 0


def test_presence_penalty_is_flat():
    out = penalize(SamplingParams(presence_penalty=0.5), torch.zeros(1, 10), [1], [5, 5, 5, 7])
    assert out[5].item() == pytest.approx(-0.5)
    assert out[7].item() == pytest.approx(-0.5)
    assert out[1].item() == 0.0


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[4.0, -4.0, 4.0, -4.0, 0.0]])
    out = penalize(SamplingParams(repetition_penalty=2.0), logits, [0], [1, 4])
    assert out.tolist() == [2.0, -8.0, 4.0, -4.0, 0.0]


def test_penalties_touch_only_rows_that_ask():
    logits = torch.ones(2, 10)
    params = [SamplingParams(frequency_penalty=1.0), SamplingParams()]
    apply_penalties(logits, params, [[], []], [[3], [3]])
    assert logits[0, 3].item() == 0.0 and logits[1, 3].item() == 1.0


def test_penalty_changes_the_greedy_choice(sampler):
    logits = torch.zeros(1, VOCAB)
    logits[0, 10] = 1.0
    logits[0, 11] = 0.9
    out = run(sampler, logits, [SamplingParams(temperature=0.0, presence_penalty=0.5)], outputs=[[10]])
    assert out.next_token_ids == [11]


def test_min_new_tokens_blocks_eos_and_stop_tokens_until_reached(sampler):
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 3.0
    logits[0, 7] = 2.0
    logits[0, 8] = 1.0
    params = SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[7])
    assert run(sampler, logits, [params], outputs=[[4]]).next_token_ids == [8]
    assert run(sampler, logits, [params], outputs=[[4, 4]]).next_token_ids == [EOS]


def test_min_new_tokens_mask_is_minus_infinity_only_where_active():
    logits = torch.zeros(2, 10)
    params = [SamplingParams(min_new_tokens=1), SamplingParams(min_new_tokens=1)]
    apply_min_new_tokens(logits, params, [[], [5]], eos_token_ids=[EOS])
    assert logits[0, EOS].item() == -math.inf
    assert torch.isfinite(logits[1]).all()
    assert torch.isfinite(logits[0, [i for i in range(10) if i != EOS]]).all()


# ---- logprobs ------------------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_distribution_and_top_lists_have_the_asked_length(sampler):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    out = run(sampler, logits, params, outputs=[[1], [], []])
    raw = torch.log_softmax(logits, dim=-1)
    for row, token in enumerate(out.next_token_ids):
        assert out.token_logprobs[row] == pytest.approx(raw[row, token].item(), abs=1e-6)
    best = raw[0].topk(3)
    assert [t for t, _ in out.top_logprobs[0]] == best.indices.tolist()
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(best.values.tolist(), abs=1e-6)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []


def test_sampling_does_not_modify_the_callers_logits(sampler):
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, min_new_tokens=3), SamplingParams(frequency_penalty=1.0)]
    run(sampler, logits, params, inputs=[[1, 2], [3]], outputs=[[4], [5]])
    assert torch.equal(logits, before)


def test_logits_wider_than_the_vocab_never_yield_padding_tokens(sampler):
    logits = torch.zeros(1, VOCAB + 6)
    logits[0, VOCAB + 2] = 100.0
    assert run(sampler, logits, [SamplingParams(temperature=0.0)]).next_token_ids[0] < VOCAB


def test_greedy_ids_is_argmax_ties_included():
    """max(dim).indices stands in for argmax: the first maximal index of every row, as argmax's."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (64, 1000), generator=gen).float()  # many ties per row
    logits[5] = 0.0  # an all-equal row
    logits[7, 10] = float("inf")
    assert torch.equal(greedy_ids(logits), logits.argmax(dim=-1))
    assert greedy_ids(logits)[5] == 0


# ---- extreme but valid parameters ----------------------------------------------------------------------
# Each of these once gave NaN probabilities (a garbage token, silently) or an index error (a 500).


@pytest.mark.parametrize("temperature", [1e-7, 1e-30, 1e-40, 1e-300, 5e-324])
def test_a_vanishing_temperature_is_greedy(sampler, temperature):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5)) * 10
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    out = run(
        sampler, logits, [SamplingParams(temperature=temperature, seed=s) for s in range(3)], generators=gens
    )
    assert out.next_token_ids == logits.argmax(-1).tolist()


def test_a_small_temperature_above_the_greedy_threshold_still_samples_the_best_token(sampler):
    """1e-5 is not greedy, but its logits (x 1e5) stay finite: the best token takes all the mass."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(6))
    out = run(sampler, logits, [SamplingParams(temperature=1e-5)] * 2)
    assert out.next_token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-30])
def test_a_vanishing_top_p_keeps_the_best_token(sampler, top_p):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(7))
    out = run(sampler, logits, [SamplingParams(temperature=1.0, top_p=top_p)] * 4)
    assert out.next_token_ids == logits.argmax(-1).tolist()


def test_a_repetition_penalty_that_overflows_samples_among_the_repeated_tokens_only(sampler):
    """Positive logits of seen tokens divided by 1e-300 (0 in float32) are +inf: sampling picks among those
    tokens, never one of the others, and never a NaN draw."""
    logits = torch.full((64, VOCAB), -1.0)
    seen = [3, 11, 17]
    logits[:, seen] = 0.5
    gens = [torch.Generator().manual_seed(s) for s in range(64)]
    params = [SamplingParams(temperature=0.7, repetition_penalty=1e-300, seed=s) for s in range(64)]
    out = run(sampler, logits, params, generators=gens, inputs=[seen] * 64)
    assert set(out.next_token_ids) == set(seen)  # all three drawn across 64 rows, nothing else


@pytest.mark.parametrize("temperature", [3.5e38, 1e300])
def test_a_temperature_past_float32_samples_uniformly_among_the_allowed_tokens(sampler, temperature):
    """inf in float32: a masked token's -inf / inf was NaN, and the row drew token 0 whatever the mask said
    (a grammar then rejected it: a 500). min_new_tokens masks EOS here."""
    draws = 400
    logits = torch.zeros(draws, VOCAB)
    logits[:, EOS] = 50.0  # the model's favourite, but masked
    gens = [torch.Generator().manual_seed(s) for s in range(draws)]
    params = [SamplingParams(temperature=temperature, min_new_tokens=1, seed=s) for s in range(draws)]
    tokens = run(sampler, logits, params, generators=gens).next_token_ids
    assert EOS not in tokens
    assert len(set(tokens)) > VOCAB // 2  # spread over the allowed tokens, not stuck on one


def test_a_repetition_penalty_below_float32_leaves_no_nan(sampler):
    """5e-324 is 0 in float32: a seen token's zero logit became 0 / 0 = NaN and the row's softmax NaN."""
    logits = torch.full((32, VOCAB), -1.0)
    logits[:, 5] = 0.0
    logits[:, 9] = 0.5
    gens = [torch.Generator().manual_seed(s) for s in range(32)]
    params = [SamplingParams(temperature=1.0, repetition_penalty=5e-324, seed=s) for s in range(32)]
    out = run(sampler, logits, params, generators=gens, inputs=[[5, 9]] * 32)
    assert set(out.next_token_ids) == {9}  # the one seen token with a positive logit: +inf
