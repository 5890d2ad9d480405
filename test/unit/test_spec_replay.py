"""Specification of scripts/spec_replay.py's model: replaying a proposer over a recorded answer advances by
the accepted drafts plus one token a step, and the bound (the longest copy from prompt + output) is never
beaten by any lookup proposer."""

from __future__ import annotations

import importlib.util
import pathlib
import random
import sys

import pytest

from srt.speculative.lookup import EVERY_MATCH_DRAFTS_K
from srt.speculative.ngram import NgramProposer
from srt.speculative.prediction import PredictionProposer

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "spec_replay.py"


@pytest.fixture(scope="module")
def replay():
    spec = importlib.util.spec_from_file_location("spec_replay", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["spec_replay"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("spec_replay", None)


def flat_cost(replay, ms: float = 10.0):
    return replay.StepCost({1: ms, 16: ms}, 0.0)  # every step the same: the ratio is tokens per step


def test_an_answer_that_copies_its_prompt_takes_one_step_per_k_plus_one_tokens(replay):
    prompt = list(range(100, 140))
    answer = prompt[:37]  # the first token comes from the prefill; 36 more follow the prompt exactly
    a = replay.Answer("grounded", prompt, answer, None)
    ratio, steps = replay.replay(
        [a], lambda: NgramProposer(min_n=1, k=8, length=EVERY_MATCH_DRAFTS_K), flat_cost(replay)
    )
    assert steps == 4  # 36 tokens, 9 a step (8 accepted drafts and the bonus token)
    assert ratio == pytest.approx(36 / 4)


def test_no_lookup_proposer_beats_the_bound(replay):
    rng = random.Random(5)
    answers = []
    for _ in range(6):
        prompt = [rng.randrange(30) for _ in range(80)]
        out = []
        while len(out) < 60:  # runs copied from the prompt, broken by fresh tokens
            start = rng.randrange(len(prompt) - 10)
            out += prompt[start : start + rng.randrange(1, 10)] + [rng.randrange(30)]
        answers.append(replay.Answer("grounded", prompt, out[:60], prompt[10:50]))
    cost = replay.StepCost({1: 7.4, 4: 8.7, 5: 10.0, 8: 12.4, 16: 21.0}, 0.7)
    bound, _ = replay.bound(answers, cost, 15)
    for make in (
        lambda: NgramProposer(),
        lambda: NgramProposer(min_n=1, k=15, length=EVERY_MATCH_DRAFTS_K),
        lambda: PredictionProposer(),
        lambda: PredictionProposer(min_n=1, k=15),
    ):
        ratio, _ = replay.replay(answers, make, cost)
        assert ratio <= bound + 1e-9
    assert bound > 1.0  # copies exist, so the bound gains something
