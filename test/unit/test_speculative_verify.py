"""Specification of lossless verification: greedy requests keep exactly the drafts the target's argmax agrees
with plus the target's own next token; sampled requests follow speculative sampling with the recovered-token
rule, so that what they emit is distributed as sampling from the target itself (a chi-square test that also
shows it would catch the classic mistake of resampling from p after a rejection); accepted counts are
always prefix lengths; and the step and request figures reconcile."""

from __future__ import annotations

import torch

from srt.sampling.token_filters import sample_from_probs
from srt.speculative.stats import SpecRequestStats, SpecStep, SpecStepStats
from srt.speculative.verify import DraftBatch, draw_uniforms, verify, verify_greedy, verify_sampled

VOCAB = 8
SAMPLES = 20_000
DRAFTS = 3
# A chi-square p-value below this rejects "same distribution": a correct verifier fails about once in a
# million seeds, and the seeds are fixed.
FALSE_ALARM = 1e-6
# Targets drawn from Dirichlet(4): no token so rare that its expected count leaves chi-square's validity.
TARGET_CONCENTRATION = 4.0


def one_hot_rows(ids: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """Target rows whose argmax (and only mass) is each id: logits for greedy, probabilities for sampling."""
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def greedy_result(drafts: list[list[int]], argmaxes: list[int]):
    batch = DraftBatch.build(drafts)
    return verify_greedy(batch, argmaxes)


# ---- layout ----


def test_draft_batch_packs_k_plus_one_target_rows_per_request():
    batch = DraftBatch.build([[5, 6], [], [7, 8, 9]])
    assert batch.draft_ids.tolist() == [[5, 6, 0], [0, 0, 0], [7, 8, 9]]
    assert batch.draft_lens.tolist() == [2, 0, 3]
    assert batch.row_starts.tolist() == [0, 3, 4]
    assert batch.num_rows == 8
    assert batch.draft_rows().tolist()[0][:2] == [0, 1] and batch.draft_rows().tolist()[2] == [4, 5, 6]


# ---- greedy ----


def test_greedy_accepts_the_prefix_the_argmax_agrees_with_then_takes_the_targets_token():
    result = greedy_result([[5, 6, 7]], [5, 6, 2, 4])
    assert result.accepted == [2]
    assert result.token_ids() == [[5, 6, 2]]


def test_greedy_all_accepted_adds_the_bonus_token():
    result = greedy_result([[5, 6, 7]], [5, 6, 7, 4])
    assert result.accepted == [3]
    assert result.token_ids() == [[5, 6, 7, 4]]


def test_greedy_first_mismatch_gives_the_targets_argmax_and_nothing_after_counts():
    result = greedy_result([[5, 6, 7]], [1, 6, 7, 4])  # later positions agree, but the first does not
    assert result.accepted == [0]
    assert result.token_ids() == [[1]]


def test_greedy_batch_with_different_draft_lengths_reads_each_requests_own_rows():
    drafts = [[5, 6], [], [7, 8, 9], [3]]
    argmaxes = [5, 1, 2] + [4] + [7, 8, 9, 6] + [0, 3]
    result = greedy_result(drafts, argmaxes)
    assert result.accepted == [1, 0, 3, 0]
    assert result.token_ids() == [[5, 1], [4], [7, 8, 9, 6], [0]]


# ---- sampled ----


def test_sampled_accepted_count_is_the_prefix_even_when_later_drafts_are_certain():
    batch = DraftBatch.build([[5, 6, 7]])
    probs = torch.stack(
        [one_hot_rows([1])[0], one_hot_rows([6])[0], one_hot_rows([7])[0], one_hot_rows([2])[0]]
    )
    uniforms = torch.full((1, 4), 0.5)
    result = verify_sampled(batch, probs, uniforms)
    assert result.accepted == [0]  # p(5) = 0 at the first position, whatever follows
    assert result.token_ids() == [[1]]  # the residual is p without 5: all on 1


def test_sampled_certain_drafts_are_accepted_and_the_bonus_drawn_from_the_last_row():
    batch = DraftBatch.build([[5, 6]])
    probs = one_hot_rows([5, 6, 3])
    result = verify_sampled(batch, probs, torch.rand(1, 3, generator=torch.Generator().manual_seed(0)))
    assert result.token_ids() == [[5, 6, 3]]


def test_a_request_without_drafts_samples_its_token_from_its_one_row():
    batch = DraftBatch.build([[], []])
    probs = torch.tensor([[0.0] * 7 + [1.0], [0.25] * 4 + [0.0] * 4])
    result = verify_sampled(batch, probs, torch.tensor([[0.3], [0.6]]))
    assert result.accepted == [0, 0]
    assert result.token_ids() == [[7], [2]]  # the second row's CDF passes 0.6 at token 2


def test_unnormalized_target_rows_are_read_as_their_normalized_distribution():
    # a filtered row keeps its surviving probabilities unscaled: p(5) = 0.2 / 0.4 = 0.5
    batch = DraftBatch.build([[5]])
    probs = torch.zeros(2, VOCAB)
    probs[0, 5], probs[0, 1], probs[1, 0] = 0.2, 0.2, 0.3
    below, above = torch.tensor([[0.0, 0.49]]), torch.tensor([[0.0, 0.51]])
    assert verify_sampled(batch, probs, below).token_ids() == [[5, 0]]
    assert verify_sampled(batch, probs, above).token_ids() == [[1]]


def chi_square_p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi-square >= observed) for token counts against `probs` (df = vocab - 1)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((probs.numel() - 1) / 2.0), stat / 2))


def speculative_samples(seed: int, full_draft_distribution: bool):
    """SAMPLES independent verify steps of DRAFTS drafts each against fixed per-position targets p_j (the
    target at position j does not depend on the tokens before it, so it is also the conditional)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.distributions.Dirichlet(torch.full((VOCAB,), TARGET_CONCENTRATION)).sample((DRAFTS + 1,))
    # drafts: sampled from q when q is a distribution; from a skewed fixed choice for point-mass drafts
    if full_draft_distribution:
        q = torch.rand(SAMPLES, DRAFTS, VOCAB, generator=gen) ** 3
        q = q / q.sum(dim=-1, keepdim=True)
        drafts = torch.multinomial(q.reshape(-1, VOCAB), 1, generator=gen).reshape(SAMPLES, DRAFTS)
    else:
        q = None
        skew = torch.arange(1, VOCAB + 1, dtype=torch.float) ** 2  # favours tokens p does not
        drafts = torch.multinomial(skew, SAMPLES * DRAFTS, replacement=True, generator=gen).reshape(
            SAMPLES, DRAFTS
        )
    batch = DraftBatch.build(drafts.tolist())
    target = p.repeat(SAMPLES, 1)  # packed: DRAFTS + 1 rows per request
    uniforms = torch.rand(SAMPLES, DRAFTS + 1, generator=gen)
    return p, batch, target, uniforms, q


def first_two_tokens(batch, result):
    """The first emitted token of every step, and the second of the steps that accepted a draft."""
    accepted, next_ids = torch.tensor(result.accepted), torch.tensor(result.next_ids)
    first = torch.where(accepted > 0, batch.draft_ids[:, 0], next_ids)
    second = torch.where(accepted > 1, batch.draft_ids[:, 1], next_ids)[accepted > 0]
    return first, second


def test_speculative_sampling_reproduces_the_target_distribution():
    for seed, full_q in [(1, False), (2, True)]:
        torch.manual_seed(seed)  # the Dirichlet targets draw from the global generator
        p, batch, target, uniforms, q = speculative_samples(seed, full_q)
        result = verify_sampled(batch, target, uniforms, q)
        first, second = first_two_tokens(batch, result)
        assert chi_square_p_value(first, p[0]) > FALSE_ALARM, full_q
        assert second.numel() > SAMPLES // 20  # enough steps accepted a draft to test the second token
        assert chi_square_p_value(second, p[1]) > FALSE_ALARM, full_q


def test_the_distribution_test_catches_resampling_from_p_after_a_rejection():
    for seed, full_q in [(1, False), (2, True)]:
        torch.manual_seed(seed)  # the Dirichlet targets draw from the global generator
        p, batch, target, uniforms, q = speculative_samples(seed, full_q)
        result = verify_sampled(batch, target, uniforms, q)
        # the mistake: after a rejection, draw the next token from p instead of max(p - q, 0)
        accepted = torch.tensor(result.accepted)
        rows = target[batch.row_starts + accepted]
        wrong_next = sample_from_probs(
            rows, torch.rand(SAMPLES, generator=torch.Generator().manual_seed(seed))
        )
        first = torch.where(accepted > 0, batch.draft_ids[:, 0], wrong_next)
        assert chi_square_p_value(first, p[0]) < FALSE_ALARM, full_q


# ---- the mixed step, randomness and figures ----


def test_a_mixed_batch_verifies_greedy_rows_by_argmax_and_sampled_rows_by_rejection_sampling():
    drafts = [[5, 6], [5, 6], [2]]
    batch = DraftBatch.build(drafts)
    logits = one_hot_rows([5, 1, 3] + [5, 6, 4] + [2, 7]) * 10
    probs = one_hot_rows([5, 1, 3] + [5, 6, 4] + [2, 7])
    greedy = [True, False, False]
    gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    result = verify(batch, logits, probs, greedy, gens)
    assert result.token_ids() == [[5, 1], [5, 6, 4], [2, 7]]
    # a draft model's q, certain of its drafts as the target is: the same tokens
    q = torch.nn.functional.one_hot(batch.draft_ids, VOCAB).float()
    with_q = verify(batch, logits, probs, greedy, gens, draft_probs=q)
    assert with_q.token_ids() == [[5, 1], [5, 6, 4], [2, 7]]


def test_a_seeded_requests_draws_do_not_depend_on_the_other_requests():
    alone = DraftBatch.build([[1, 2]])
    crowded = DraftBatch.build([[3, 4, 5, 6, 7], [1, 2]])
    shared = torch.Generator().manual_seed(0)
    u_alone = draw_uniforms(alone, [torch.Generator().manual_seed(42)])
    u_crowded = draw_uniforms(crowded, [shared, torch.Generator().manual_seed(42)])
    assert torch.equal(u_alone[0, :3], u_crowded[1, :3])


def test_the_same_seeds_give_the_same_step():
    p, batch, target, _, _ = speculative_samples(5, False)
    runs = [
        verify(
            batch,
            None,
            target,
            [False] * SAMPLES,
            [torch.Generator().manual_seed(9)] * SAMPLES,
        )
        for _ in range(2)
    ]
    assert runs[0].accepted == runs[1].accepted and runs[0].next_ids == runs[1].next_ids


def test_step_totals_equal_the_sums_of_the_request_figures():
    p, batch, target, uniforms, q = speculative_samples(11, True)
    lens = [0, 1, 2, 3] * 50
    drafts = [ids[:k] for ids, k in zip(batch.draft_ids[:200].tolist(), lens, strict=True)]
    small = DraftBatch.build(drafts)
    rows = torch.cat([torch.arange(k + 1) for k in lens])  # position j of every request reads p_j
    result = verify_sampled(small, p[rows], uniforms[:200])

    steps = [SpecStep(1, k, a) for k, a in zip(lens, result.accepted, strict=True)]
    step = SpecStepStats.from_steps(steps)
    per_request = [SpecRequestStats() for _ in lens]
    for stats, s in zip(per_request, steps, strict=True):
        stats.record(s)
    assert step.num_drafts == sum(s.verify_steps for s in per_request) == 150  # no draft: not a spec step
    assert step.num_draft_tokens == sum(s.draft_tokens for s in per_request)
    assert step.num_accepted_tokens == sum(s.accepted_tokens for s in per_request) <= step.num_draft_tokens
    counts = step.accepted_per_position
    assert all(a >= b for a, b in zip(counts, counts[1:], strict=False))
    assert list(counts) == [sum(a > j for a in result.accepted) for j in range(DRAFTS)]
