"""`/tokenize` answers are written piece by piece (so the event loop gets turns while a large one is written):
the text must be exactly the JSON Starlette's JSONResponse would send, for every shape the routes answer."""

from __future__ import annotations

import json

import pytest

from srt.http_server.serving_tokenize import JSON_PIECE_ITEMS, _dumps

N = JSON_PIECE_ITEMS
ANSWERS = [
    {"count": 3, "tokens": [1, 2, 3], "token_strs": ["a", 'é"\n', "Ġ"], "max_model_len": 8192},
    {"count": N * 2 + 1, "tokens": list(range(N * 2 + 1)), "token_strs": ["x"] * (N * 2 + 1)},
    {"count": [0, N + 1], "tokens": [[], list(range(N + 1))], "token_strs": [[], ["\\"] * (N + 1)]},
    {"tokens": list(range(N)), "also": list(range(N + 1)), "empty": []},
    {"prompt": "a\u2028\x00b😀", "text": "a\u2028\x00b😀"},
]


@pytest.mark.parametrize("answer", ANSWERS, ids=range(len(ANSWERS)))
def test_pieces_make_the_same_json_as_one_dump(answer):
    text = _dumps(answer)
    assert text == json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    assert json.loads(text) == answer
