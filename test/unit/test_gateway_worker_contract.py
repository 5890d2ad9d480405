"""What a gateway reads from an srt worker, field by field: the model card's `owned_by`, `/server_info`'s and
`/model_info`'s names and types (the Shepherd Model Gateway drops a whole answer whose field has the wrong
type, and refuses `model` beside `model_id`), `/v1/loads` in SGLang's schema with one entry per replica,
vLLM's `/tokenizer_info`, and the usage a streamed chunk carries with `continuous_usage_stats`.
test/integration/test_smg_gateway.py checks the same against a real gateway."""

from __future__ import annotations

import json

from srt.http_server.load_report import loads_body, unknown_sections
from srt.http_server.openai.response_frame import chunk_usage
from srt.http_server.openai.serving_common import ChoiceAcc
from srt.http_server.server_info import OWNED_BY, model_card, model_info, server_info, tokenizer_info
from srt.io_struct import SchedulerReady
from srt.metrics.load_snapshot import RankLoad, SchedulerLoadReader, SchedulerLoadWriter
from srt.server_args import ServerArgs
from srt.tokenizer_loading import load_tokenizer

READY = SchedulerReady(
    max_total_num_tokens=4096, max_req_input_len=2000, context_len=2048, max_running_requests=32,
    attention_backend="torch_native",
)  # fmt: skip


def test_the_model_card_names_sglang_so_gateways_need_no_fallback_probe():
    card = model_card("m", 1, 2048)
    assert card["owned_by"] == OWNED_BY == "sglang"
    assert card["id"] == card["root"] == "m" and card["max_model_len"] == 2048


def test_server_info_reports_the_sizes_in_effect_under_sglangs_names():
    info = server_info(ServerArgs(served_model_name="m", api_key="secret"), READY, "0.1.0")
    assert info["model_id"] == info["served_model_name"] == "m" and "model" not in info
    assert info["context_length"] == 2048 and info["max_total_tokens"] == 4096
    assert info["max_running_requests"] == 32
    assert info["tp_size"] == 1 and info["dp_size"] == 1 and info["load_balance_method"] == "round_robin"
    assert info["is_embedding"] is False and info["version"] == "0.1.0"
    assert "api_key" not in info
    json.dumps(info)  # the answer is plain JSON


def test_model_info_carries_the_architecture_from_the_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    info = model_info(ServerArgs(served_model_name="m"), str(tmp_path), 2048)
    assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
    assert info["is_generation"] is True and info["tokenizer_path"] == info["model_path"] == str(tmp_path)
    assert model_info(ServerArgs(), str(tmp_path / "none"), 1)["model_type"] is None


def test_loads_have_one_entry_per_replica_in_absolute_tokens():
    ranks = [RankLoad(0, 2, 1, 300, 1000, 12.5, 0.5), RankLoad(1, 0, 0, 0, 1000, 0.0, 0.0)]
    body = loads_body(ranks, max_running_requests=32)
    assert body["dp_rank_count"] == 2 and isinstance(body["timestamp"], str)
    first = body["loads"][0]
    assert first == {
        "dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 1, "num_total_reqs": 3, "num_used_tokens": 300,
        "max_total_num_tokens": 1000, "token_usage": 0.3, "gen_throughput": 12.5, "cache_hit_rate": 0.5,
        "utilization": 0.3, "max_running_requests": 32,
    }  # fmt: skip
    counts = ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens")
    assert all(type(entry[k]) is int for entry in body["loads"] for k in counts)  # the gateway reads i32


def test_load_sections_are_sglangs():
    assert unknown_sections(None) == [] and unknown_sections("core,queues,memory") == []
    assert unknown_sections("core, gpu,") == ["gpu"]


def test_the_reader_keeps_each_replica_apart(tmp_path):
    for rank, used, hit in ((0, 100, 0.25), (1, 300, 0.75)):
        writer = SchedulerLoadWriter(str(tmp_path), rank)
        writer.write(
            running=1, waiting=rank, used_tokens=used, capacity=1000, gen_throughput=5.0, cache_hit_rate=hit
        )
    ranks = SchedulerLoadReader(str(tmp_path)).read_ranks()
    assert [[r.dp_rank, r.num_waiting_reqs, r.num_used_tokens, r.cache_hit_rate] for r in ranks] == [
        [0, 0, 100, 0.25],
        [1, 1, 300, 0.75],
    ]


def test_tokenizer_info_answers_what_lm_evals_remote_tokenizer_reads(model_assets_dir):
    tokenizer = load_tokenizer(model_assets_dir)
    info = tokenizer_info(tokenizer, 2048)
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == 2048
    assert info["tokenizer_class"] == type(tokenizer).__name__
    json.dumps(info)


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk():
    choice = ChoiceAcc(prompt_tokens=7, completion_tokens=3)
    assert chunk_usage(False, False, choice) == {}
    assert chunk_usage(True, False, choice) == {"usage": None}  # usage comes in the closing chunk only
    assert chunk_usage(True, True, choice) == {
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    }
