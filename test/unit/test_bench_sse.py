"""Server-Sent Events decoding and the per-backend payload parsing the client's TTFT/ITL depend on."""

import json

from srt_bench.sse import GenerateStreamParser, SSEDecoder, parse_openai_payload


def test_events_split_across_reads_come_out_whole_and_once():
    dec = SSEDecoder()
    stream = b'data: {"a": 1}\n\ndata: {"b"' + b": 2}\n\n" + b"data: [DONE]\n\n"
    out = []
    for i in range(0, len(stream), 5):
        out += dec.feed(stream[i : i + 5])
    assert out == ['{"a": 1}', '{"b": 2}', "[DONE]"]


def test_crlf_comments_other_fields_and_multiline_data():
    dec = SSEDecoder()
    out = dec.feed(b": keep-alive\r\n\r\nevent: message\r\nid: 7\r\ndata: line1\r\ndata:line2\r\n\r\n")
    assert out == ["line1\nline2"]


def test_multibyte_text_split_between_reads_is_decoded_intact():
    payload = 'data: {"t": "héllo ✓"}\n\n'.encode()
    split = payload.index("✓".encode()) + 1
    dec = SSEDecoder()
    assert dec.feed(payload[:split]) == []
    assert json.loads(dec.feed(payload[split:])[0])["t"] == "héllo ✓"


def test_unterminated_last_event_is_returned_by_flush():
    dec = SSEDecoder()
    assert dec.feed(b"data: last") == []
    assert dec.flush() == ["last"]
    assert dec.flush() == []


def test_chat_role_only_chunk_and_usage_chunk_carry_no_output():
    role = parse_openai_payload(json.dumps({"choices": [{"delta": {"role": "assistant"}}]}), chat=True)
    assert not role.has_output
    usage = parse_openai_payload(
        json.dumps({"choices": [], "usage": {"prompt_tokens": 31, "completion_tokens": 5}}), chat=True
    )
    assert not usage.has_output
    assert (usage.prompt_tokens, usage.completion_tokens) == (31, 5)


def test_chat_and_completion_chunks_yield_their_text():
    chat = parse_openai_payload(json.dumps({"choices": [{"delta": {"content": "Hi"}}]}), chat=True)
    completion = parse_openai_payload(json.dumps({"choices": [{"text": " there"}]}), chat=False)
    assert chat.has_output and chat.text == "Hi"
    assert completion.text == " there"


def test_done_sentinel_and_error_payloads():
    assert parse_openai_payload("[DONE]", chat=True).done
    err = parse_openai_payload(json.dumps({"error": {"message": "too long"}}), chat=True)
    assert err.error == "too long"


def test_generate_stream_turns_cumulative_text_and_counts_into_deltas():
    parser = GenerateStreamParser()
    first = parser.parse(
        json.dumps({"text": "Hel", "meta_info": {"completion_tokens": 1, "prompt_tokens": 9}})
    )
    second = parser.parse(json.dumps({"text": "Hello", "meta_info": {"completion_tokens": 2}}))
    # a token that does not complete a character yet: no text, but still output
    third = parser.parse(json.dumps({"text": "Hello", "meta_info": {"completion_tokens": 3}}))
    assert (first.text, first.new_tokens, first.prompt_tokens) == ("Hel", 1, 9)
    assert (second.text, second.new_tokens) == ("lo", 1)
    assert third.has_output and third.text == "" and third.completion_tokens == 3
    assert parser.parse("[DONE]").done


def test_generate_stream_accepts_incremental_text_too():
    parser = GenerateStreamParser()
    assert parser.parse(json.dumps({"text": "ab"})).text == "ab"
    assert parser.parse(json.dumps({"text": "cd"})).text == "cd"
