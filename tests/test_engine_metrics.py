"""The load gateways read: the gauges of the Gateway API Inference Extension's model-server
protocol under vLLM's names (what llm-d's endpoint picker scrapes by default) and SGLang's,
parsed from ``/metrics``'s text with prometheus_client's parser (names, types, labels,
values), and SGLang's ``/v1/loads`` body, while a request runs and after it."""

from __future__ import annotations

import asyncio

import pytest
from conftest import make_tiny_checkpoint
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from radixd import Engine, SamplingParams
from radixd.server.errors import ApiError
from radixd.server.metrics import Metrics

GAUGES = {  # name -> labels, as vLLM v1 and SGLang export them
    "vllm:num_requests_running": {"model_name", "engine"},
    "vllm:num_requests_waiting": {"model_name", "engine"},
    "vllm:kv_cache_usage_perc": {"model_name", "engine"},
    "vllm:cache_config_info": {"block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype", "engine"},
    "sglang:num_running_reqs": {"model_name", "dp_rank"},
    "sglang:num_queue_reqs": {"model_name", "dp_rank"},
    "sglang:token_usage": {"model_name", "dp_rank"},
    "sglang:num_used_tokens": {"model_name", "dp_rank"},
    "sglang:max_total_num_tokens": {"model_name", "dp_rank"},
    "sglang:cache_hit_rate": {"model_name", "dp_rank"},
    "sglang:gen_throughput": {"model_name", "dp_rank"},
    "sglang:cache_config_info": {"page_size", "num_pages", "model_name", "dp_rank"},
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("metrics") / "llama", "llama")


def scrape(metrics: Metrics) -> dict[str, tuple[str, list]]:
    text = generate_latest(metrics.registry).decode()
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def value(fams, name: str) -> float:
    (sample,) = fams[name][1]
    return sample.value


async def test_gauges_by_name_type_and_labels(model):
    eng = Engine(model=str(model), kv_cache_tokens=512, kv_events_block_size=8)
    metrics = Metrics(eng, "tiny")
    try:
        idle = scrape(metrics)
        for name, labels in GAUGES.items():
            kind, samples = idle[name]
            assert kind == "gauge", name
            assert len(samples) == 1 and samples[0].name == name and set(samples[0].labels) == labels, samples
        info = idle["vllm:cache_config_info"][1][0]
        assert info.value == 1.0 and info.labels["block_size"] == "8" and info.labels["num_gpu_blocks"] == "64"
        assert info.labels["enable_prefix_caching"] == "True" and info.labels["engine"] == "0"
        sgl = idle["sglang:cache_config_info"][1][0].labels
        assert (sgl["page_size"], sgl["num_pages"]) == ("8", "64")
        assert idle["vllm:num_requests_running"][1][0].labels == {"model_name": "tiny", "engine": "0"}
        assert value(idle, "sglang:max_total_num_tokens") == 512

        sub = eng.submit(input_ids=list(range(3, 40)), params=SamplingParams(max_new_tokens=64, ignore_eos=True))
        outs = aiter(sub)
        await anext(outs)
        busy = scrape(metrics)
        assert value(busy, "vllm:num_requests_running") == 1 == value(busy, "sglang:num_running_reqs")
        assert value(busy, "vllm:num_requests_waiting") == 0 == value(busy, "sglang:num_queue_reqs")
        used = value(busy, "sglang:num_used_tokens")
        assert used >= 37 and value(busy, "vllm:kv_cache_usage_perc") == pytest.approx(used / 512)
        body = metrics.load.loads_body(64)
        (load,) = body["loads"]
        assert body["dp_rank_count"] == 1 and load["num_running_reqs"] == 1 and load["max_total_num_tokens"] == 512
        async for _ in outs:
            pass
        await asyncio.sleep(1.05)  # the generation rate is taken over a second at least
        done = scrape(metrics)
        # the finished prompt stays cached (radixd's own ratio counts it), but no one holds it:
        # vLLM's and SGLang's usage are of blocks in use
        assert value(done, "radixd_kv_usage_ratio") > 0
        assert value(done, "vllm:kv_cache_usage_perc") == 0 == value(done, "sglang:token_usage")
        assert value(done, "vllm:num_requests_running") == 0
        assert value(scrape(metrics), "sglang:gen_throughput") > 0
    finally:
        await eng.stop()


def test_loads_include_sections():
    from radixd.server.engine_load import check_include

    check_include(None)
    check_include("core,disagg,queues,memory")
    with pytest.raises(ApiError, match="'include' names an unknown section 'nope'"):
        check_include("core,nope")


async def test_one_sample_per_data_parallel_rank(model):
    eng = Engine(model=str(model), kv_cache_tokens=256, dp_size=2)
    metrics = Metrics(eng, "tiny")
    try:
        fams = scrape(metrics)
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:cache_config_info"):
            assert sorted(s.labels["engine"] for s in fams[name][1]) == ["0", "1"], name
        assert sorted(s.labels["dp_rank"] for s in fams["sglang:token_usage"][1]) == ["0", "1"]
        body = metrics.load.loads_body(64)
        assert body["dp_rank_count"] == 2 and [x["dp_rank"] for x in body["loads"]] == [0, 1]
        assert [x["max_total_num_tokens"] for x in body["loads"]] == [256, 256]
    finally:
        await eng.stop()
