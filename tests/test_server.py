"""The OpenAI-compatible server on a tiny random target + draft, driven by the official ``openai``
client and raw HTTP: outputs equal plain greedy decoding, streaming equals non-streaming,
stop strings, malformed requests (400 with the reason), the API key, 20 concurrent clients,
live acceptance metrics, adaptive depth, memory over 1,000 requests and start-up mismatches."""

from __future__ import annotations

import concurrent.futures
import gc
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from eagle3.distributed import free_port
from eagle3.target.chat import ChatFormat
from eagle3.target.model import Target
from serve_eval.adaptive import CostModel
from serve_eval.config import SpecConfig
from serve_eval.lookup import SharedLookup
from serve_eval.server import Engine, TextStream, build_app, main
from serve_eval.spec_decode import SpeculativeDecoder
from serve_eval.traffic import TrafficError, TrafficLog, read_traffic
from tests.helpers import TINY_VOCAB, make_draft, randomised, tiny_llama, tiny_tokenizer

MODEL = "tiny"
KEY = "test-key"




class Served:
    def __init__(self, engine: Engine, api_key: str | None) -> None:
        import uvicorn

        self.engine, self.port = engine, free_port()
        config = uvicorn.Config(build_app(engine, api_key), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.close()


def tiny_engine(adaptive: bool = False, max_model_len: int = 256, traffic: TrafficLog | None = None,
                proposer: str = "draft", shared: SharedLookup | None = None, live: Path | None = None) -> Engine:
    torch.manual_seed(0)
    target = Target(tiny_llama(num_layers=6, vocab=TINY_VOCAB), tiny_tokenizer(), aux_layer_ids=(1, 2, 3))
    decoder = SpeculativeDecoder(target, make_draft(target), SpecConfig("chain", k=3, proposer=proposer))
    chat = ChatFormat.for_tokenizer(target.tokenizer)
    cost = CostModel([0.010, 0.011, 0.012, 0.013], 0.001) if adaptive else None
    capture = follower = None
    if live is not None:
        from serve_eval.capture import CaptureWriter, serving_spec
        from serve_eval.promoted import DraftFollower

        capture = CaptureWriter(live / "capture", serving_spec(target, MODEL, chat, "float32", max_model_len), 2**30)
        from eagle3.export import fit_to_target, load_draft

        def load(folder: Path | None) -> object:
            if folder is None:
                return make_draft(target)
            loaded = load_draft(folder)
            fit_to_target(loaded, target)
            return loaded.draft.eval()

        follower = DraftFollower(live, load)
    return Engine(decoder, chat, model_name=MODEL, max_model_len=max_model_len, adaptive=adaptive, cost=cost,
                  prior=[0.9, 0.9, 0.9], recent_requests=8, traffic=traffic, shared=shared, capture=capture,
                  follower=follower)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served(tiny_engine(), KEY)
    yield s
    s.stop()


def plain_text(engine: Engine, prompt: list[int], n: int) -> tuple[str, list[int]]:
    tokens = SpeculativeDecoder(engine.decoder.target, None).generate(prompt, n, engine.chat.stop_ids).tokens
    return engine.tokenizer.decode(tokens, skip_special_tokens=True), tokens


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three primes."}]


def test_chat_equals_plain_greedy_decoding_and_streams_the_same_text(served: Served) -> None:
    client = served.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    prompt = served.engine.chat.prompt_ids(MESSAGES)
    text, tokens = plain_text(served.engine, prompt, 24)
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == ("stop" if tokens[-1] in served.engine.chat.stop_ids else "length")
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(tokens)
    assert r.model_extra["spec_decode"]["tau"] >= 1.0

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [r.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(tokens) and not chunks[-1].choices
    # text parts are one message, joined by newlines as vLLM joins them
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Name three"},
                                                       {"type": "text", "text": "primes."}]}]
    r = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0)
    joined = served.engine.chat.prompt_ids([MESSAGES[0], {"role": "user", "content": "Name three\nprimes."}])
    assert r.usage.prompt_tokens == len(joined)
    assert r.choices[0].message.content == plain_text(served.engine, joined, 8)[0]


def test_completions_with_text_and_token_prompts(served: Served) -> None:
    client = served.client()
    ids = served.engine.tokenizer("Once upon a time", add_special_tokens=True)["input_ids"]
    text, _ = plain_text(served.engine, ids, 16)
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    assert r.choices[0].text == text
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0)
    assert r2.choices[0].text == text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, stream=True))
    assert streamed == text
    # sampling: a seed makes it reproducible
    a = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    b = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    assert a.choices[0].text == b.choices[0].text


def test_stop_strings_truncate_and_finish_with_stop(served: Served) -> None:
    client = served.client()
    full = client.completions.create(model=MODEL, prompt="hello", max_tokens=40, temperature=0).choices[0].text
    printable = [i for i in range(3, len(full) - 2) if full[i:i + 2].isprintable() and "\ufffd" not in full[i:i + 2]]
    if not printable:
        pytest.skip("the random model produced no printable two-character window")
    cut = printable[0]
    stop = full[cut:cut + 2]
    first = full.find(stop)
    for stream in (False, True):
        if stream:
            parts = list(client.completions.create(model=MODEL, prompt="hello", max_tokens=40, temperature=0,
                                                   stop=[stop, "\x00never"], stream=True))
            text = "".join(p.choices[0].text for p in parts)
            reason = [p.choices[0].finish_reason for p in parts if p.choices[0].finish_reason][0]
        else:
            r = client.completions.create(model=MODEL, prompt="hello", max_tokens=40, temperature=0,
                                          stop=[stop, "\x00never"])
            text, reason = r.choices[0].text, r.choices[0].finish_reason
            # usage counts the tokens up to the stop string, not the rest of that verify round
            ids = served.engine.tokenizer("hello", add_special_tokens=True)["input_ids"]
            tokens = plain_text(served.engine, ids, 40)[1]
            used = r.usage.completion_tokens
            decode = served.engine.tokenizer.decode
            assert len(decode(tokens[:used], skip_special_tokens=True)) >= first
            assert len(decode(tokens[:used - 1], skip_special_tokens=True)) < first
        assert text == full[:first]
        assert reason == "stop"


def test_text_stream_holds_back_partial_stop_strings() -> None:
    tok = tiny_tokenizer()
    s = TextStream(tok, ["END"])
    ids = tok("abcEN", add_special_tokens=False)["input_ids"]
    out = "".join(s.push([i])[0] for i in ids)
    assert out == "abc"  # "EN" may still become "END"
    delta, hit = s.push(tok("D tail", add_special_tokens=False)["input_ids"])
    assert (delta, hit) == ("", True) and s.text == "abc"
    s2 = TextStream(tok, ["END"])
    s2.push(tok("abEN", add_special_tokens=False)["input_ids"])
    assert s2.push(tok("x", add_special_tokens=False)["input_ids"]) == ("ENx", False)
    # a multi-byte character split across tokens is never sent half
    s3 = TextStream(tok)
    ids = tok("é", add_special_tokens=False)["input_ids"]
    assert len(ids) == 2 and s3.push(ids[:1]) == ("", False) and s3.push(ids[1:]) == ("é", False)


BAD = [
    (b"\xff\xfe{not utf-8", "not valid UTF-8"),
    (b'{"model": "tiny", "messages": [', "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"model": "tiny"}', "messages"),
    (b'{"model": "tiny", "messages": []}', "messages"),
    (b'{"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}', "role"),
    (b'{"model": "tiny", "messages": [{"role": "user"}]}', "content"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}', "temperature"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}', "top_p"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_tokens"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2}', "n"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}',
     "maximum context length"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["a","b","c","d","e"]}', "stop"),
    (b'{"model": "tiny", "messages": [{"role": "assistant", "content": "hi"}]}', "user message"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": 100000000000000000000000}', "seed"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": true, '
     b'"stream_options": {"include_usage": "no"}}', "include_usage"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"description": "x"}]}',
     "tools[0] has no function name"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, '
     b'"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "user", "content": "?"}]}',
     "calls f (id c) but no tool result"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "4"}]}',
     "tool after user"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": null}]}', "content is required"),
]


@pytest.mark.parametrize("body,reason", BAD)
def test_malformed_chat_requests_are_400_with_the_reason(served: Served, body: bytes, reason: str) -> None:
    r = httpx.post(f"{served.url}/v1/chat/completions", content=body, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert reason in err["message"] and err["type"] == "invalid_request_error"


def test_an_agent_requests_tools_call_and_result_reach_the_prompt(served: Served) -> None:
    """The schemas and the conversation's call and result reach the prompt as the chat template
    renders them (this template reads no ``tools``: they go into the system prompt, which takes this
    byte-level target past its 256 positions: the refusal counts the prompt's tokens)."""
    from eagle3.target.chat import ChatFormat

    messages = [{"role": "user", "content": "t?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c", "content": "4"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = httpx.post(f"{served.url}/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny", "messages": messages, "tools": tools, "max_tokens": 4, "temperature": 0})
    prompt = ChatFormat.for_tokenizer(tiny_tokenizer()).with_tools(tools).prompt_ids(
        [{**m, "content": m["content"] or ""} for m in messages])
    assert r.status_code == 400 and f"the prompt has {len(prompt)} and 4 more" in r.json()["error"]["message"]
    without = ChatFormat.for_tokenizer(tiny_tokenizer()).prompt_ids([{**m, "content": m["content"] or ""}
                                                                     for m in messages])
    assert len(without) < len(prompt)


def test_malformed_completions_and_the_openai_client_errors(served: Served) -> None:
    client = served.client()
    long_prompt = "x" * 400  # a byte tokenizer: 400 tokens > max_model_len 256
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=MODEL, prompt=[1, 99999], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.completions.create(model=MODEL, prompt=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="one prompt"):
        client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.completions.create(model="gpt-4", prompt="a", max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        served.client("wrong").completions.create(model=MODEL, prompt="a", max_tokens=4)
    assert httpx.get(f"{served.url}/health").json()["status"] == "ok"  # /health needs no key


def test_twenty_concurrent_clients_and_live_metrics(served: Served) -> None:
    client = served.client()

    def one(i: int) -> str:
        if i % 2:
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"question {i}"}], max_tokens=10,
                temperature=0, stream=True) if c.choices)
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"question {i}"}],
                                              max_tokens=10, temperature=0).choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        outs = list(pool.map(one, range(20)))
    for i, out in enumerate(outs):  # each equals its own plain greedy decoding
        prompt = served.engine.chat.prompt_ids([{"role": "user", "content": f"question {i}"}])
        assert out == plain_text(served.engine, prompt, 10)[0]

    text = httpx.get(f"{served.url}/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['eagle3_requests_total{endpoint="chat",outcome="ok"}'] >= 20
    drafts = values["eagle3_spec_decode_num_drafts_total"]
    assert drafts > 0
    assert values['eagle3_spec_decode_num_draft_tokens_per_pos_total{position="1"}'] == drafts
    accepted = [values[f'eagle3_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in (1, 2, 3)]
    assert sum(accepted) == values["eagle3_spec_decode_num_accepted_tokens_total"]
    assert accepted[0] >= accepted[1] >= accepted[2]
    by_context = {k: v for k, v in values.items() if k.startswith("eagle3_spec_decode_rounds_by_context_total")}
    assert list(by_context) == ['eagle3_spec_decode_rounds_by_context_total{context="0-1k"}']  # short prompts
    assert 0 < values['eagle3_spec_decode_accepted_tokens_by_context_total{context="0-1k"}'] <= 3 * drafts
    recent = [k for k in values if k.startswith("eagle3_request_tau{")]
    assert len(recent) == 8  # the window of recent requests is bounded
    assert any(k.startswith('eagle3_request_acceptance{request_id="chatcmpl-') for k in values)


def test_twenty_concurrent_clients_with_the_hybrid_and_a_capped_shared_index() -> None:
    shared = SharedLookup(max_tokens=120)
    s = Served(tiny_engine(proposer="hybrid", shared=shared), KEY)
    try:
        client = s.client()
        # requests that repeat: the lookup continues within a request and from earlier replies
        asks = [f"repeat after me: {' '.join(['alpha beta gamma'] * (1 + i % 3))} question {i % 5}" for i in range(20)]

        def one(i: int) -> str:
            return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": asks[i]}],
                                                  max_tokens=16, temperature=0).choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            outs = list(pool.map(one, range(20)))
        for ask, out in zip(asks, outs, strict=True):  # each equals its own plain greedy decoding
            assert out == plain_text(s.engine, s.engine.chat.prompt_ids([{"role": "user", "content": ask}]), 16)[0]
        values = {}
        for line in httpx.get(f"{s.url}/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        assert values['eagle3_requests_total{endpoint="chat",outcome="ok"}'] == 20
        by = {source: sum(v for k, v in values.items() if k.startswith("eagle3_spec_decode_accepted_tokens_by_"
                                                                        f'proposer_total{{context="0-1k",proposer="{source}"'))
              for source in ("draft", "lookup", "both")}
        assert sum(by.values()) == values["eagle3_spec_decode_num_accepted_tokens_total"]
        assert by["lookup"] + by["both"] > 0
        assert values['eagle3_spec_decode_lookup_rounds_total{context="0-1k"}'] > 0
        # the shared index: capped and counted
        assert values["eagle3_lookup_shared_added"] == 20 and values["eagle3_lookup_shared_max_tokens"] == 120
        assert values["eagle3_lookup_shared_tokens"] <= 120 and values["eagle3_lookup_shared_evicted"] > 0
        assert values["eagle3_lookup_shared_tokens"] == shared.tokens
    finally:
        s.stop()


def test_adaptive_depth_keeps_outputs_and_reports_depths() -> None:
    s = Served(tiny_engine(adaptive=True), None)
    try:
        client = s.client("unused")
        for i in range(3):
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}],
                                               max_tokens=20, temperature=0)
            prompt = s.engine.chat.prompt_ids([{"role": "user", "content": f"q{i}"}])
            assert r.choices[0].message.content == plain_text(s.engine, prompt, 20)[0]
            assert 0.0 <= r.model_extra["spec_decode"]["mean_depth"] <= 3.0
        # a random draft is almost never accepted: the policy learns to stop speculating
        assert r.model_extra["spec_decode"]["mean_depth"] < 2.0
        assert "eagle3_request_mean_depth" in httpx.get(f"{s.url}/metrics").text
    finally:
        s.stop()


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_memory_is_stable_over_a_thousand_requests(served: Served) -> None:
    body = {"model": MODEL, "prompt": "memory check", "max_tokens": 2, "temperature": 0}
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        for _ in range(200):
            assert http.post("/v1/completions", json=body).status_code == 200
        gc.collect()
        before = _rss_mb()
        for i in range(800):
            r = http.post("/v1/completions", json=body if i % 2 else {**body, "stream": True})
            assert r.status_code == 200
        gc.collect()
        after = _rss_mb()
    assert after - before < 25, f"RSS grew {after - before:.1f} MB over 800 requests"


def test_startup_refuses_a_draft_that_does_not_fit(tmp_path: Path, tiny_model_dir: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle3.draft.model import DraftConfig, Eagle3Draft
    from eagle3.target.model import load_target
    from eagle3.train.checkpoint import export_draft

    target = load_target(str(tiny_model_dir), dtype="float32", device="cpu")
    ids = list(target.aux_layer_ids)

    def write(name: str, hidden: int, info: dict) -> Path:
        config = DraftConfig.from_target_config(target.config, draft_vocab_size=TINY_VOCAB)
        config.target_hidden_size = hidden
        draft = Eagle3Draft(config, torch.zeros(TINY_VOCAB, config.hidden_size))
        state = {k: v for k, v in draft.state_dict().items() if not k.startswith("embed_tokens")}
        export_draft(tmp_path / name, state, config, {"aux_layer_ids": ids, **info})
        return tmp_path / name

    cases = [
        (write("hidden", target.hidden_size * 2, {}), "target_hidden_size"),
        (write("tokenizer", target.hidden_size, {"tokenizer_sha256": "0" * 64}), "another tokenizer"),
        (write("ids", target.hidden_size, {"aux_layer_ids": [1, 2, 99]}), "out of range"),
    ]
    for folder, reason in cases:
        assert main(["--draft", str(folder), "--target", str(tiny_model_dir)]) == 2
        assert reason in capsys.readouterr().err
    assert json.loads((cases[0][0] / "draft.json").read_text())["aux_layer_ids"] == ids

    # a draft that fits starts, with the flags passed on (uvicorn stubbed out)
    import uvicorn

    import serve_eval.server as server

    started: list[Engine] = []
    monkeypatch.setattr(server, "build_app", lambda engine, key: started.append(engine))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: None)
    fits = write("fits", target.hidden_size, {})
    assert main(["--draft", str(fits), "--target", str(tiny_model_dir), "--recent-requests", "5"]) == 0
    assert started[0].metrics.recent.maxlen == 5
    with pytest.raises(SystemExit):
        main(["--draft", str(fits), "--recent-requests", "-1"])
    assert "--recent-requests must be >= 0" in capsys.readouterr().err
    # the lookup: served without a draft; a hybrid needs one; the shared index needs the lookup
    assert main(["--target", str(tiny_model_dir), "--proposer", "lookup", "--lookup-shared-tokens", "64"]) == 0
    assert started[-1].decoder.proposer is None and started[-1].shared.max_tokens == 64
    assert main(["--target", str(tiny_model_dir), "--proposer", "hybrid"]) == 2
    assert "--draft: proposer=hybrid needs a draft" in capsys.readouterr().err
    assert main(["--draft", str(fits), "--target", str(tiny_model_dir), "--lookup-shared-tokens", "64"]) == 2
    assert "--lookup-shared-tokens: the shared lookup index needs" in capsys.readouterr().err
    assert main(["--draft", str(fits), "--target", str(tiny_model_dir), "--proposer", "hybrid", "--mode", "tree",
                 "--budget", "4"]) == 2
    assert "budget=4" in capsys.readouterr().err


def test_the_opt_in_traffic_log_holds_what_mining_reads_and_nothing_else(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "traffic.jsonl"
    s = Served(tiny_engine(traffic=TrafficLog(log, 6000)), KEY)
    try:
        client = s.client()
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)  # not a chat: not logged
        (line,) = [json.loads(x) for x in log.read_text().splitlines()]
        assert set(line) == {"messages", "prompt_ids", "reply_ids", "finish_reason", "k", "rounds", "tau"}
        assert KEY not in log.read_text() and "Authorization" not in log.read_text()
        assert line["messages"] == MESSAGES and line["prompt_ids"] == s.engine.chat.prompt_ids(MESSAGES)
        assert s.engine.tokenizer.decode(line["reply_ids"], skip_special_tokens=True) == r.choices[0].message.content
        assert line["tau"] == r.model_extra["spec_decode"]["tau"] and line["k"] == 3
        assert all(r[2] == sum(r[3:]) for r in line["rounds"])  # accepted = by draft + by lookup + by both
        accepted = sum(r[2] for r in line["rounds"])  # every reply token: a round's accepted + its own
        assert accepted + len(line["rounds"]) + 1 >= len(line["reply_ids"])
        for _ in range(6000 // len(log.read_bytes())):  # the cap: lines stop, whole, once the next would pass it
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
        lines = log.read_text().splitlines()
        assert log.stat().st_size <= 6000 and all(json.loads(x)["messages"] == MESSAGES for x in lines)
        assert log.stat().st_size + len(log.read_bytes()) // len(lines) > 6000  # it stopped at the cap
    finally:
        s.stop()
    (record,) = read_traffic(log)  # one distinct prompt
    assert record["domain"] == "traffic" and record["messages"] == MESSAGES
    assert record["meta"]["served_tau"] == pytest.approx(line["tau"], abs=1e-3)
    log.write_text(log.read_text() + "{not json\n")
    with pytest.raises(TrafficError, match=f"{log}:{len(lines) + 1}: not a traffic log line"):
        read_traffic(log)
    with pytest.raises(TrafficError, match="no such traffic log"):
        read_traffic(tmp_path / "none.jsonl")


def test_live_serving_captures_every_request_and_swaps_drafts_between_requests(tmp_path: Path) -> None:
    """--live: each finished request one captured sample (ids as served, no text), the same outputs and
    target forwards as without; a promoted draft serves from the next request on, its version counted."""
    from eagle3.export import export_draft_folder
    from serve_eval.capture import committed, read_captured, read_spec
    from serve_eval.promoted import publish

    live = tmp_path / "live"
    s = Served(tiny_engine(live=live), KEY)
    plain = Served(tiny_engine(), KEY)
    try:
        client, ref = s.client(), plain.client()
        prompts = [[{"role": "user", "content": f"Count to {i}."}] for i in range(4)]
        for messages in prompts[:2]:
            a = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
            b = ref.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
            assert a.choices[0].message.content == b.choices[0].message.content
        draft = randomised(make_draft(s.engine.decoder.target), seed=3)
        folder = export_draft_folder(tmp_path / "candidate", draft.state_dict(), draft.config, (1, 2, 3),
                                     dtype="float32")
        publish(live, folder, {"why": "test"})
        for messages in prompts[2:]:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
        metrics = httpx.get(f"{s.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    finally:
        s.stop()
        plain.stop()
    items = committed(live / "capture")
    assert [c.record["draft_version"] for c in items] == [0, 0, 1, 1]
    assert s.engine.decoder.draft is not None and s.engine.follower.version == 1
    spec = read_spec(live / "capture")
    sample = read_captured(items[0], spec)
    assert sample.input_ids.tolist()[: int((~sample.loss_mask).sum())] == s.engine.chat.prompt_ids(prompts[0])
    assert b"Count to" not in items[0].path.read_bytes() and KEY not in items[0].path.with_suffix(".json").read_text()
    assert "eagle3_draft_version 1.0" in metrics and "eagle3_capture_requests 4.0" in metrics
    assert 'eagle3_spec_decode_rounds_by_draft_version_total{version="1"}' in metrics
