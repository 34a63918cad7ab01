"""The OpenAI-compatible front (serve/openai_api/) against a real tritonserver serving SmolLM2 fp32 draft-target,
driven by the official openai client, sync and async: text equal to the gRPC path's, stop, max_tokens and seed
honoured, 16 concurrent streams, fields it cannot honour refused by name, a disconnect that cancels, and a drain that
answers 503. The request checks and the stop handling also run without a server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from helpers.served import LONG, MAX_TOKENS, PROMPTS, plain_text, wait_for_idle

from specdeploy.bench.server_load import run_level
from specdeploy.errors import RequestError
from specdeploy.package.repository import write_repository
from specdeploy.serve import openai_client
from specdeploy.serve.client import generate
from specdeploy.serve.metrics_scrape import scrape, total
from specdeploy.serve.openai_api.front import OpenAIFront
from specdeploy.serve.openai_api.protocol import ApiError, StopTail, chat_request, completion_request
from specdeploy.serve.tritonserver import TritonServer
from specdeploy.spec.request import NO_END_ID

MODEL = "smollm2-fp32"


class Words:
    """A tokenizer stand-in: a token per character, no chat template."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def refusal(body: dict, chat: bool = True) -> ApiError:
    with pytest.raises(ApiError) as caught:
        (chat_request if chat else completion_request)(body, Words(), MODEL)
    return caught.value


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": -1}, "presence_penalty"), ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"temperature": 3}, "temperature"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"max_tokens": 0}, "max_tokens"), ({"frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
])
def test_fields_the_server_cannot_honour_are_refused_by_name(extra, param):
    error = refusal({**CHAT, **extra})
    assert error.status == 400 and error.param == param and param in error.message
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_an_unknown_model_is_a_404_and_the_extensions_reach_the_model():
    assert refusal({**CHAT, "model": "gpt-4"}).status == 404
    generation = chat_request({**CHAT, "top_k": 40, "repetition_penalty": 1.1, "seed": 7, "max_completion_tokens": 9,
                               "stop": "x", "stream": True, "stream_options": {"include_usage": True},
                               "num_draft_tokens": 2, "request_kind": "chat", "user": "u1"}, Words(), MODEL)
    assert generation.inputs == {"temperature": None, "top_p": None, "top_k": 40, "repetition_penalty": 1.1,
                                 "random_seed": 7, "num_draft_tokens": 2, "request_kind": "chat", "max_tokens": 9}
    assert generation.stop == ["x"] and generation.stream and generation.include_usage
    assert not generation.continuous_usage
    generation = chat_request({**CHAT, "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, Words(),
                              MODEL)
    assert generation.inputs["end_id"] == NO_END_ID and generation.continuous_usage
    completion = completion_request({"model": MODEL, "prompt": ["ab"], "max_tokens": 3}, Words(), MODEL)
    assert completion.prompt_ids == [97, 98] and not completion.chat
    assert refusal({"model": MODEL, "prompt": "a", "echo": True}, chat=False).param == "echo"
    assert refusal({"model": MODEL, "prompt": ""}, chat=False).param == "prompt"


def test_a_stop_sequence_is_left_out_even_when_it_arrives_in_pieces():
    tail = StopTail(["\n\n", "END"])
    sent = [tail.add("Hello\n", False), tail.add("world", False)]
    assert sent == ["Hello", "\nworld"]  # "\n" held until the next piece showed it was no stop
    tail = StopTail(["\n\n"])
    assert tail.add("Hi\n", False) + tail.add("\n", True) == "Hi"
    assert StopTail(["END"]).add("no stop here EN", True) == "no stop here EN"  # ended otherwise: all of it


def test_the_bench_client_maps_the_grpc_fields_onto_an_openai_request():
    assert openai_client.is_openai_url("http://host:9000/v1") and not openai_client.is_openai_url("host:8001")
    body = openai_client.request_body(MODEL, "hi", 7, True, {"num_draft_tokens": 0, "temperature": 0.0,
                                                             "random_seed": 3, "end_id": NO_END_ID,
                                                             "stop_words": ["x"], "top_k": None})
    assert body == {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "max_tokens": 7,
                    "num_draft_tokens": 0, "temperature": 0.0, "seed": 3, "ignore_eos": True, "stop": ["x"]}
    with pytest.raises(RequestError, match="end_id"):
        openai_client.request_body(MODEL, "hi", 7, True, {"end_id": 2})
    assert openai_client.connection("http://h:9/v1", 1)[1] == "/v1" == openai_client.connection("http://h:9", 1)[1]


@pytest.fixture(scope="module")
def front(smollm2_fp32_engines, tmp_path_factory):
    engine = smollm2_fp32_engines["draft-target"]
    root = tmp_path_factory.mktemp("openai")
    repository = write_repository(engine.dir, root / "repository")
    with TritonServer(repository, log_file=root / "tritonserver.log") as server:
        with OpenAIFront(repository, server.grpc_url) as front:
            yield front, server, engine


def client(front_url: str):
    import openai

    return openai.OpenAI(base_url=front_url, api_key="unused", max_retries=0)


@pytest.mark.smollm2
@pytest.mark.slow
def test_chat_text_is_the_grpc_paths_streamed_or_not_with_usage(front):
    front, server, engine = front
    expected = plain_text(engine, PROMPTS[0])
    assert "".join(c.text for c in generate(server.grpc_url, PROMPTS[0], MAX_TOKENS)) == expected
    messages = [{"role": "user", "content": PROMPTS[0]}]
    whole = client(front.url).chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
    assert whole.choices[0].message.content == expected and whole.choices[0].finish_reason == "length"
    usage = whole.usage
    assert usage.completion_tokens == MAX_TOKENS and usage.prompt_tokens == len(engine.encode_prompt(PROMPTS[0]))
    speculation = usage.model_extra["speculation"]
    assert 0 < speculation["accepted_tokens"] <= speculation["drafted_tokens"]
    chunks = list(client(front.url).chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


@pytest.mark.smollm2
@pytest.mark.slow
def test_stop_and_seed_are_honoured(front):
    front, server, engine = front
    expected = plain_text(engine, PROMPTS[0])
    messages = [{"role": "user", "content": PROMPTS[0]}]
    stopped = client(front.url).chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                        stop="\n")
    assert stopped.choices[0].message.content == expected[:expected.index("\n")]
    assert stopped.choices[0].finish_reason == "stop"
    sampled = [client(front.url).chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                         temperature=0.9, seed=seed).choices[0].message.content
               for seed in (5, 5, 6)]
    assert sampled[0] == sampled[1] and len(set(sampled)) == 2


@pytest.mark.smollm2
@pytest.mark.slow
def test_sixteen_async_streams_each_get_their_own_text(front):
    import openai

    front, _, engine = front
    expected = {p: plain_text(engine, p) for p in PROMPTS}

    async def one(api, prompt: str) -> str:
        stream = await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=MAX_TOKENS, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    async def all_of_them() -> list[str]:
        api = openai.AsyncOpenAI(base_url=front.url, api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(api, PROMPTS[i % 4]) for i in range(16)))

    assert asyncio.run(all_of_them()) == [expected[PROMPTS[i % 4]] for i in range(16)]


@pytest.mark.smollm2
@pytest.mark.slow
def test_completions_take_raw_text_and_bad_requests_name_the_field(front):
    import openai

    front, _, engine = front
    prompt = "The capital of France is"
    ids = engine.tokenizer(prompt)["input_ids"]
    from specdeploy.spec.sampling_params import SamplingParams

    expected = engine.decode(engine.generate(ids, SamplingParams(), 8, num_draft_tokens=0).run())
    result = client(front.url).completions.create(model=MODEL, prompt=prompt, max_tokens=8)
    assert result.choices[0].text == expected and result.object == "text_completion"
    with pytest.raises(openai.BadRequestError) as caught:
        client(front.url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3)
    assert caught.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as caught:  # the model's own refusal, through Triton
        client(front.url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                  extra_body={"top_k": -1})
    assert "top_k" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client(front.url).chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert [m.id for m in client(front.url).models.list()] == [MODEL]


@pytest.mark.smollm2
@pytest.mark.slow
def test_a_client_that_disconnects_mid_stream_cancels_its_request(front):
    import http.client

    front, server, _ = front
    labels = {"model": "speculative", "method": "draft_target"}
    capacity = total(scrape(server.metrics_url), "specdeploy_free_kv_slots", **labels)
    cancelled = total(scrape(server.metrics_url), "specdeploy_requests_total", outcome="cancelled")
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 1500, "stream": True}
    connection = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    events = 0
    while events < 3:
        events += response.readline().startswith(b"data: ")
    assert total(scrape(server.metrics_url), "specdeploy_free_kv_slots", **labels) < capacity
    connection.sock.close()  # the client goes away mid-stream, without a word
    connection.close()
    wait_for_idle(server, capacity, 10)  # the connection closed: the request was cancelled, not run to its end
    assert total(scrape(server.metrics_url), "specdeploy_requests_total", outcome="cancelled") == cancelled + 1


@pytest.mark.smollm2
@pytest.mark.slow
def test_a_draining_front_is_not_ready_and_answers_503_while_live_streams_finish(smollm2_fp32_engines, tmp_path):
    engine = smollm2_fp32_engines["draft-target"]
    repository = write_repository(engine.dir, tmp_path / "repository")
    with TritonServer(repository, log_file=tmp_path / "tritonserver.log") as server:
        front = OpenAIFront(repository, server.grpc_url).start()
        with urllib.request.urlopen(f"http://127.0.0.1:{front.port}/health/ready") as response:
            assert json.loads(response.read()) == {"ready": True}
        live: dict = {}

        def stream() -> None:
            chunks = client(front.url).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=120, stream=True)
            live["text"] = "".join(c.choices[0].delta.content or "" for c in chunks)

        thread = threading.Thread(target=stream)
        thread.start()
        while not total(scrape(server.metrics_url), "specdeploy_batch_size", model="speculative",
                        method="draft_target"):
            time.sleep(0.05)
        front.drain()
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"http://127.0.0.1:{front.port}/health/ready")
        assert caught.value.code == 503
        request = urllib.request.Request(f"{front.url}/chat/completions", method="POST",
                                         data=json.dumps({**CHAT, "model": MODEL}).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request)
        assert caught.value.code == 503 and caught.value.headers["Retry-After"]
        thread.join(60)
        assert live["text"] == plain_text(engine, LONG, 120)  # the live stream finished
        assert front.stop() == 0


@pytest.mark.smollm2
@pytest.mark.slow
def test_a_full_front_answers_429_until_a_request_ends(front):
    front_, server, engine = front
    with OpenAIFront(front_.repository, server.grpc_url, max_requests=1) as limited:
        request = urllib.request.Request(f"{limited.url}/chat/completions", method="POST",
                                         data=json.dumps({**CHAT, "model": MODEL, "max_tokens": 4}).encode(),
                                         headers={"Content-Type": "application/json"})
        chunks = client(limited.url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=40, stream=True)
        text = next(iter(chunks)).choices[0].delta.content or ""  # the stream runs: the front is full
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request)
        assert caught.value.code == 429 and caught.value.headers["Retry-After"]
        error = json.loads(caught.value.read())["error"]
        assert error["code"] == "overloaded" and "limit of 1" in error["message"]
        text += "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == plain_text(engine, LONG, 40)  # the running stream lost nothing
        with urllib.request.urlopen(request) as response:  # it ended: the front takes work again
            assert json.loads(response.read())["usage"]["completion_tokens"] == 4


@pytest.mark.smollm2
@pytest.mark.slow
def test_the_demo_shows_a_curl_line_the_openai_endpoint_answers(smollm2_fp32_engines, shared_root):
    from helpers.cli import run_cli

    engine = smollm2_fp32_engines["draft-target"]
    root = shared_root / "smollm2"
    result = run_cli("demo", str(root / "fp32.yaml"), PROMPTS[0], "--engines-dir", str(root / "engines"),
                     "--max-tokens", str(MAX_TOKENS))
    assert result.returncode == 0, result.stderr
    curl = next(line.strip() for line in result.stdout.splitlines() if line.strip().startswith("curl -s http://"))
    assert "/v1/chat/completions" in curl and f'"model": "{MODEL}"' in curl
    answer = json.loads(result.stdout.split("→ ", 1)[1].splitlines()[0])
    assert answer["content"] == plain_text(engine, PROMPTS[0])  # the gRPC path's text, over HTTP
    assert answer["usage"]["speculation"]["verification_steps"] > 0


@pytest.mark.smollm2
@pytest.mark.slow
def test_bench_drives_either_protocol_with_the_same_requests_and_the_same_counts(front):
    """bench --url's load generator over gRPC and over the OpenAI API: one stream, the same texts, tokens and
    speculation counts (from usage in every chunk), plain too; ignore_eos runs to max_tokens past the end."""
    front, server, engine = front
    results = {}
    for url in (server.grpc_url, front.url):
        for gamma in (None, 0):
            level = run_level(url, PROMPTS[:2], 1, 2, MAX_TOKENS, num_draft_tokens=gamma)
            results[url, gamma] = [(r.text, r.generated_tokens, r.drafted, r.accepted, r.finished, len(r.timing.bursts))
                                   for r in level.results]
    for gamma in (None, 0):
        assert results[server.grpc_url, gamma] == results[front.url, gamma]
    assert [text for text, *_ in results[front.url, None]] == [plain_text(engine, p) for p in PROMPTS[:2]]
    assert all(drafted > 0 for _, _, drafted, *_ in results[front.url, None])
    assert all(drafted == 0 for _, _, drafted, *_ in results[front.url, 0])
    chunks = list(openai_client.generate(front.url, "Say hi.", 40, temperature=0.0, end_id=NO_END_ID))
    counts = [int(c.statistics["generated_tokens"]) for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 40 and chunks[-1].final
