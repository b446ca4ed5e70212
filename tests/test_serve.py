"""``hybridkv serve``: the OpenAI-compatible server on the demo model, through the official client.

One server runs in process for the module (uvicorn in a thread, an API key, a media directory);
the answers it gives are compared with the CLI's (``Session.answer`` of a shared request, what ``hybridkv ask MEDIA
-Q QUESTION`` runs) computed with the same model before the server starts.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[1]
NEEDLE, SHAPES = ROOT / "sample_media" / "needle.mp4", ROOT / "sample_media" / "shapes.mp4"
KEY = "sk-test-key"
QUESTIONS = [json.loads(line)["question"] for line in (ROOT / "sample_media" / "questions.jsonl").open()]
SHAPES_QUESTION = "Which shape appears first?"
IMAGES = [ROOT / "sample_media" / "images" / name for name in ("red_circle.png", "blue_square.jpg")]
IMAGE_QUESTION = "Which image has a red circle?"
TEXT, TEXT_QUESTION = "The pass key is 4711. Remember it.", "What is the pass key?"
SERVED_DIR: list[str] = []  # the server's --allowed-media-dir (set by the server fixture)


def data_url(path: Path, media_type: str = "video/mp4") -> str:
    return f"data:{media_type};base64," + base64.b64encode(path.read_bytes()).decode()


def video_message(url: str, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("allowed")
    shutil.copy(NEEDLE, folder / "needle.mp4")
    shutil.copy(NEEDLE, folder.parent / "secret.mp4")  # ../secret.mp4, outside the directory
    os.symlink(folder.parent / "secret.mp4", folder / "link.mp4")  # a link out of the directory
    (folder / "broken.mp4").write_bytes(NEEDLE.read_bytes()[:40] + b"\0" * 4000)  # looks like MP4, does not decode
    return folder


@contextmanager
def serving(session, settings, kv_memory: int | None = None):
    """``settings``' server around ``session`` on a free port, uvicorn in a thread (``kv_memory``:
    its ``--kv-memory`` in bytes); yields its URL."""
    import uvicorn

    from hybridkv_cli.engine import Limits
    from hybridkv_cli.serve.app import create_app
    from hybridkv_cli.serve.metrics import Metrics
    from hybridkv_cli.serve.worker import Worker

    metrics = Metrics()
    limits = Limits(batch_size=settings.max_batch, kv_memory=kv_memory)
    app = create_app(Worker(session, settings, limits, metrics), settings, metrics)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uv.started
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(15)


@pytest.fixture(scope="module")
def server(media_dir):
    """``(base_url, expected answers)``: a served demo model; the answers are the CLI's."""
    from hybridkv_cli.runs.inputs import Item
    from hybridkv_cli.runs.requests import Request
    from hybridkv_cli.runs.session import AskOptions, Session
    from hybridkv_cli.serve.settings import ServeSettings

    session = Session(AskOptions(model="demo", defer_question=True, max_new_tokens=32))

    def answer_all(item, questions, context=None):  # what `hybridkv ask MEDIA -Q ... -Q ...` answers
        answers = session.answer([Request(questions=tuple(questions), item=item, context=context, shared=True)])
        return [a.record for a in sorted(answers, key=lambda a: a.index)]

    records = answer_all(Item((str(NEEDLE),)), QUESTIONS)
    expected = {(NEEDLE.name, r["question"]): r["answer"] for r in records}
    expected["record"] = records[QUESTIONS.index("What colour is the star?")]
    expected[(SHAPES.name, SHAPES_QUESTION)] = answer_all(Item((str(SHAPES),)), [SHAPES_QUESTION])[0]["answer"]
    expected["images"] = answer_all(Item(tuple(map(str, IMAGES))), [IMAGE_QUESTION])[0]["answer"]
    expected["text"] = answer_all(Item(()), [TEXT_QUESTION], context=TEXT)[0]["answer"]
    expected["session"] = session
    settings = ServeSettings(model_id="demo", allowed_media_dir=str(media_dir), api_key=KEY,
                             max_body_bytes=2**20, max_messages=64, max_batch=8, queue_size=64, body_timeout_s=2.0)
    with serving(session, settings) as base:
        SERVED_DIR[:] = [str(media_dir)]
        yield base, expected


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def metric(base: str, name: str, key: str | None = KEY) -> float:
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {}).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def stream_answer(client, messages, **kw) -> tuple[str, float, list]:
    """The streamed text, the seconds to its first content, and the chunks."""
    start, first, chunks = time.perf_counter(), None, []
    for chunk in client.chat.completions.create(model="demo", messages=messages, stream=True, **kw):
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - start
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, first, chunks


# --- answers -------------------------------------------------------------------------------------
def test_answers_equal_the_cli_from_a_data_url_and_a_file(server, client):
    base, expected = server
    assert expected[(NEEDLE.name, "What colour is the star?")] == "red"
    for url in (data_url(NEEDLE), "needle.mp4", f"file://{SERVED_DIR[0]}/needle.mp4"):
        for question in QUESTIONS:
            r = client.chat.completions.create(model="demo", messages=video_message(url, question))
            assert r.choices[0].message.content == expected[(NEEDLE.name, question)], (url[:40], question)
            assert r.choices[0].finish_reason == "stop"
            assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 512  # 512 visual tokens + the text
    cli = expected["record"]  # the record of `hybridkv ask needle.mp4 -Q "What colour is the star?"`
    info = client.chat.completions.create(model="demo", messages=video_message(
        data_url(NEEDLE), "What colour is the star?")).model_extra["hybridkv"]
    for field in ("visual_tokens", "text_tokens", "frames_used", "frame_size"):
        assert info["input"][field] == cli["input"][field], field
    assert (info["method"], info["budget"], info["decode"]["tokens"]) == (cli["method"], cli["budget"],
                                                                         cli["decode"]["tokens"])
    for field in ("device_bytes", "device_bytes_after_prefill", "host_bytes", "full_bytes"):
        assert info["kv"][field] == cli["kv"][field], field  # the same compressed cache, byte for byte
    text, _, chunks = stream_answer(client, video_message(data_url(NEEDLE), "What colour is the star?"),
                                    stream_options={"include_usage": True})
    assert text == "red"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content  # with its text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens >= 1 and not chunks[-1].choices


def test_an_image_set_and_a_text_prompt_equal_the_cli(server, client):
    base, expected = server
    images = [{"type": "image_url", "image_url": {"url": data_url(IMAGES[0], "image/png")}},
              {"type": "image_url", "image_url": {"url": data_url(IMAGES[1], "image/jpeg")}}]
    r = client.chat.completions.create(model="demo", messages=[
        {"role": "user", "content": [*images, {"type": "text", "text": IMAGE_QUESTION}]}])
    assert r.choices[0].message.content == expected["images"]
    assert r.model_extra["hybridkv"]["input"]["kind"] == "images"
    r = client.chat.completions.create(model="demo", messages=[
        {"role": "user", "content": [{"type": "text", "text": TEXT}, {"type": "text", "text": TEXT_QUESTION}]}])
    assert r.choices[0].message.content == expected["text"]
    assert r.model_extra["hybridkv"]["input"]["kind"] == "text"


def test_second_question_about_a_video_is_a_prefix_cache_hit_and_skips_prefill(server, client):
    base, expected = server
    url = data_url(SHAPES)
    misses, hits = metric(base, "hybridkv_prefix_cache_misses_total"), metric(base, "hybridkv_prefix_cache_hits_total")
    include = {"stream_options": {"include_usage": True}}
    first_text, first_ttft, first = stream_answer(client, video_message(url, SHAPES_QUESTION), **include)
    assert metric(base, "hybridkv_prefix_cache_misses_total") == misses + 1
    second_text, second_ttft, second = stream_answer(client, video_message(url, SHAPES_QUESTION), **include)
    assert metric(base, "hybridkv_prefix_cache_hits_total") == hits + 1
    assert first_text == second_text == expected[(SHAPES.name, SHAPES_QUESTION)]
    info = [c.model_extra["hybridkv"] for c in first + second if c.model_extra.get("hybridkv")]
    assert [i["prefix_cache_hit"] for i in info] == [False, True]
    usage = [c.usage for c in first + second if c.usage is not None]
    cached = [u.prompt_tokens_details.cached_tokens for u in usage]  # the media and the template before it
    assert cached[0] == 0 and info[1]["input"]["visual_tokens"] < cached[1] < usage[1].prompt_tokens
    assert info[0]["prefix_prefill_s"] > 0 and info[1]["prefix_prefill_s"] is None
    # the miss decodes the video, runs the vision encoder and prefills; a hit reads the question only
    # (about 4x faster here; the best of two hits, so one slow moment of a busy machine does not decide)
    again = stream_answer(client, video_message(url, SHAPES_QUESTION))[1]
    assert min(second_ttft, again) < first_ttft / 2, (first_ttft, second_ttft, again)


def stock_answer(session, media_path: Path, turns: list[tuple[str, str]], max_new_tokens: int, scores: list = None):
    """``(prompt tokens, answer)`` of the stock model's greedy ``generate`` on the chat template's
    rendering of ``turns`` ((role, text) each; the video in the first user turn); ``scores``: a
    list given gets the log probabilities of each answer token's step ([V] each)."""
    from hybridkv_cli.models import families
    from hybridkv_cli.models.prompt import video_kwargs

    loaded, media = session.model(), session.load_media([str(media_path)])
    messages, video = [], [{"type": "video"}]
    for role, text in turns:
        messages.append({"role": role, "content": [*(video if role == "user" else []), {"type": "text", "text": text}]})
        video = video if role != "user" else []
    text = loaded.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    height, width = media.size
    meta = video_kwargs(fps=media.sample_fps or 2.0, num_frames=media.frames_used)["video_metadata"]
    inputs = loaded.processor(text=[text], videos=[media.video], return_tensors="pt", videos_kwargs=families.media_kwargs(
        loaded.processor, "video", media.frames_used * height * width, meta))
    length = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        out = loaded.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                                    return_dict_in_generate=True)
    if scores is not None:
        scores.extend(step[0].float().log_softmax(-1) for step in out.scores)
    return length, loaded.tokenizer.decode(out.sequences[0, length:], skip_special_tokens=True).strip()


def test_a_conversation_goes_on_after_the_kept_prefix_as_the_model_reads_it_whole(server, client):
    """A chat about a video: the follow-up (the first question, its answer, a new question) reuses
    the video's kept prefix and reads the turns after it; its prompt is token for token the chat
    template's rendering of the whole conversation, and with method full its answer is the stock
    model's greedy answer to that conversation. A system prompt is rendered before the media: a
    prefix of its own, and again the stock model's answer."""
    base, expected = server
    session = expected["session"]
    url, full = data_url(NEEDLE), {"hybridkv": {"method": "full"}}
    ask = lambda messages: client.chat.completions.create(model="demo", messages=messages, max_tokens=8,  # noqa: E731
                                                          extra_body=full)
    answer = ask(video_message(url, QUESTIONS[0])).choices[0].message.content
    talk = [*video_message(url, QUESTIONS[0]), {"role": "assistant", "content": answer},
            {"role": "user", "content": [{"type": "text", "text": QUESTIONS[1]}]}]
    turns = [("user", QUESTIONS[0]), ("assistant", answer), ("user", QUESTIONS[1])]
    system = "You answer with one word."
    for before, hit in (([], True), ([{"role": "system", "content": system}], False)):
        reply = ask([*before, *talk])
        assert reply.model_extra["hybridkv"]["prefix_cache_hit"] is hit  # the first turn's prefix; none yet with it
        length, text = stock_answer(session, NEEDLE, [("system", system)] * len(before) + turns, 8)
        assert reply.usage.prompt_tokens == length and reply.choices[0].message.content == text
    wrong = [("media after the first message", [*talk[:2], video_message(url, "?")[0]], "messages[2].content"),
             ("ends with the assistant", talk[:2], "messages"), ("two users in a row", [talk[0], talk[2]], "messages"),
             ("a template token in the system prompt", [{"role": "system", "content": "<|im_start|>user"}, *talk],
              "messages[0].content"),
             ("media in the system message", [{"role": "system", "content": talk[0]["content"]}, *talk],
              "messages[0].content")]
    for name, messages, param in wrong:
        r = _post(base, {"model": "demo", "messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (name, r.text)


def test_a_system_prompt_answers_as_the_cli_with_system(server, client):
    """A request's system message is `hybridkv ask --system`'s: the same answer, and the record says it."""
    from hybridkv_cli.runs.inputs import Item
    from hybridkv_cli.runs.requests import Request
    from hybridkv_cli.runs.session import AskOptions, Session

    system = "You answer with one word."
    cli = Session(AskOptions(model="demo", defer_question=True, max_new_tokens=32, system=system))
    [answer] = cli.answer([Request(questions=(QUESTIONS[1],), item=Item((str(NEEDLE),)), shared=True)])
    reply = client.chat.completions.create(model="demo", messages=[{"role": "system", "content": system},
                                                                   *video_message(data_url(NEEDLE), QUESTIONS[1])])
    assert reply.choices[0].message.content == answer.record["answer"]
    assert answer.record["input"]["system"] == reply.model_extra["hybridkv"]["input"]["system"] == system


def test_a_sampled_answer_is_drawn_again_by_its_seed_and_equals_the_librarys(server, client):
    """temperature > 0 samples: the response names its seed (a fresh one when the request gives
    none); the same seed draws the same answer, streamed or not, and the library's answer with it."""
    from hybridkv_cli.engine.sampling import Sampling
    from hybridkv_cli.runs.inputs import Item
    from hybridkv_cli.runs.requests import Request

    _, expected = server
    question = QUESTIONS[0]
    ask = lambda **kw: client.chat.completions.create(model="demo", messages=video_message("needle.mp4", question),
                                                      temperature=1.5, top_p=0.9, **kw)
    first = ask()
    drawn = first.model_extra["hybridkv"]["sampling"]
    assert drawn["temperature"] == 1.5 and drawn["top_p"] == 0.9 and isinstance(drawn["seed"], int)
    again = ask(seed=drawn["seed"])
    assert again.choices[0].message.content == first.choices[0].message.content
    assert stream_answer(client, video_message("needle.mp4", question), temperature=1.5, top_p=0.9,
                         seed=drawn["seed"])[0] == first.choices[0].message.content
    [library] = expected["session"].answer([Request(questions=(question,), item=Item((str(NEEDLE),)), shared=True,
                                                    sampling=Sampling(1.5, 0.9, drawn["seed"]))])
    assert library.record["answer"] == first.choices[0].message.content and library.record["sampling"] == drawn
    assert ask().model_extra["hybridkv"]["sampling"]["seed"] != drawn["seed"]  # no seed given: a fresh one each time
    greedy = client.chat.completions.create(model="demo", messages=video_message("needle.mp4", question),
                                            temperature=0, seed=5)
    assert greedy.choices[0].message.content == expected[(NEEDLE.name, question)]
    assert greedy.model_extra["hybridkv"]["sampling"] is None


def test_n_answers_are_each_drawn_by_its_seed_streamed_or_not(server, client):
    """n: several answers to one request, each over its own copy of the one kept prefix; sampled,
    answer i is the one request of seed + i gives; streamed, each answer's chunks carry its index
    and end with its finish reason; usage counts the prompt once and every answer's tokens."""
    _, expected = server
    question = QUESTIONS[2]  # the digit: the demo draws it apart at temperature 2 for some seeds
    ask = lambda **kw: client.chat.completions.create(model="demo", messages=video_message("needle.mp4", question),
                                                      temperature=2.0, max_tokens=8, **kw)
    several = ask(n=4, seed=12)
    texts = [c.message.content for c in several.choices]
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert texts == [ask(seed=12 + i).choices[0].message.content for i in range(4)]
    assert len(set(texts)) > 1  # drawn apart at this temperature
    alone = [ask(seed=12 + i).usage for i in range(4)]
    assert several.usage.prompt_tokens == alone[0].prompt_tokens
    assert several.usage.completion_tokens == sum(u.completion_tokens for u in alone)
    chunks = stream_answer(client, video_message("needle.mp4", question), temperature=2.0, max_tokens=8, n=4,
                           seed=12)[2]
    streamed = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(4)}
    assert [streamed[i] for i in range(4)] == texts
    ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(e.index for e in ends) == [0, 1, 2, 3]
    assert all(sum(1 for c in chunks if c.choices and c.choices[0].index == i and c.choices[0].delta.role) == 1
               for i in range(4))  # each answer's first chunk names the role, once
    greedy = client.chat.completions.create(model="demo", messages=video_message("needle.mp4", question), n=2)
    assert [c.message.content for c in greedy.choices] == [expected[(NEEDLE.name, question)]] * 2


def test_penalties_are_the_librarys_and_named_in_the_response(server, client):
    """presence_penalty / frequency_penalty: the answer the library gives with the same sampling,
    greedy too; the response's hybridkv.sampling names them."""
    from hybridkv_cli.engine.sampling import Sampling
    from hybridkv_cli.runs.inputs import Item
    from hybridkv_cli.runs.requests import Request

    _, expected = server
    question = QUESTIONS[2]
    reply = client.chat.completions.create(model="demo", messages=video_message("needle.mp4", question),
                                           presence_penalty=-2, frequency_penalty=0.5, max_tokens=8)
    sampling = Sampling(0.0, 1.0, 0, -2.0, 0.5)
    [library] = expected["session"].answer([Request(questions=(question,), item=Item((str(NEEDLE),)), shared=True,
                                                    max_new_tokens=8, sampling=sampling)])
    assert reply.choices[0].message.content == library.record["answer"]
    assert reply.model_extra["hybridkv"]["sampling"] == library.record["sampling"] == {
        "temperature": 0.0, "top_p": 1.0, "seed": 0, "presence_penalty": -2.0, "frequency_penalty": 0.5}


def test_logprobs_are_the_stock_models_streamed_or_not(server, client):
    """logprobs / top_logprobs: each answer token's log probability and best alternatives, as the
    stock model's own scores give them (method full), in the response or, streamed, with the text
    chunk its token completes."""
    _, expected = server
    tokenizer = expected["session"].model().tokenizer
    ask = dict(model="demo", messages=video_message(data_url(NEEDLE), QUESTIONS[0]), max_tokens=6, logprobs=True,
               top_logprobs=3, extra_body={"hybridkv": {"method": "full"}})
    reply = client.chat.completions.create(**ask)
    scores = []
    stock_answer(expected["session"], NEEDLE, [("user", QUESTIONS[0])], 6, scores)
    content = reply.choices[0].logprobs.content
    assert content and "".join(t.token for t in content).strip() == reply.choices[0].message.content
    for entry, row in zip(content, scores):
        best = row.topk(3)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([i]) for i in best.indices.tolist()]
        assert entry.token == entry.top_logprobs[0].token and abs(entry.logprob - best.values[0].item()) < 1e-4
        assert all(abs(t.logprob - v) < 1e-4 for t, v in zip(entry.top_logprobs, best.values.tolist()))
        assert entry.bytes == list(entry.token.encode())
    chunks = [c.choices[0] for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    streamed = [t.model_dump() for c in chunks if c.logprobs for t in c.logprobs.content]
    assert streamed == [t.model_dump() for t in content]  # each token's once, in order
    first = next(c for c in chunks if c.delta.content)
    assert first.logprobs.content[0].token == content[0].token  # with the text its token makes, not at the end
    assert client.chat.completions.create(**{**ask, "logprobs": None, "top_logprobs": None}).choices[0].logprobs is None
    r = _post(server[0], _good(top_logprobs=2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_stop_strings_and_max_tokens(server, client):
    messages = video_message(data_url(NEEDLE), "What colour is the star?")
    r = client.chat.completions.create(model="demo", messages=messages, stop=["e"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("r", "stop")
    text, _, chunks = stream_answer(client, messages, stop="ed")
    assert text == "r" and chunks[-1].choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="demo", messages=messages, max_tokens=1)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"
    assert "red".startswith(r.choices[0].message.content)


def test_concurrent_clients_get_the_cli_answers_decoded_together(server, client):
    base, expected = server
    asks = [(path, question) for path, question in
            [(NEEDLE, q) for q in QUESTIONS[:3]] + [(SHAPES, SHAPES_QUESTION)]] * 2  # 8 clients, 2 videos
    urls = {NEEDLE: data_url(NEEDLE), SHAPES: data_url(SHAPES)}

    def ask(pair):
        path, question = pair
        r = client.chat.completions.create(model="demo", messages=video_message(urls[path], question))
        return r.choices[0].message.content, r.model_extra["hybridkv"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, asks))
    assert [text for text, _ in results] == [expected[(p.name, q)] for p, q in asks]
    assert max(info["batch"]["size_max"] for _, info in results) > 1  # decoded together, not one at a time


def test_under_kv_memory_the_decoding_kv_never_exceeds_it(server, client):
    """--kv-memory: concurrent requests decode together as their measured device KV allows, and
    the decoding answers' device KV is never above the cap (each answer's batch peak and the
    metrics' peak); the answers are the CLI's."""
    from hybridkv_cli.runs.session import AskOptions, Session
    from hybridkv_cli.serve.settings import ServeSettings

    base, expected = server
    url = data_url(NEEDLE)
    lone = client.chat.completions.create(model="demo", messages=video_message(url, QUESTIONS[0]))
    cap = 3 * lone.model_extra["hybridkv"]["batch"]["kv_device_bytes_peak"]  # room for two or so at once
    session = Session(AskOptions(model="demo", defer_question=True, max_new_tokens=32))
    settings = ServeSettings(model_id="demo", api_key=KEY, max_body_bytes=2**20, max_messages=64, max_batch=8,
                             queue_size=64)
    with serving(session, settings, kv_memory=cap) as capped:
        capped_client = openai.OpenAI(base_url=capped + "/v1", api_key=KEY, max_retries=0, timeout=60)
        asks = QUESTIONS[:4] * 2

        def ask(question):
            r = capped_client.chat.completions.create(model="demo", messages=video_message(url, question))
            return r.choices[0].message.content, r.model_extra["hybridkv"]["batch"]

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(ask, asks))
        peak = metric(capped, "hybridkv_decoding_kv_device_bytes_peak")
    assert [text for text, _ in results] == [expected[(NEEDLE.name, q)] for q in asks]
    assert all(batch["kv_memory"] == cap and 0 < batch["kv_device_bytes_peak"] <= cap for _, batch in results)
    assert max(batch["size_max"] for _, batch in results) > 1  # the cap admits more than one at a time
    assert 0 < peak <= cap


def test_concurrent_requests_for_new_media_prefill_it_once_beside_the_decoding(server, client, tmp_path):
    """Six clients ask at once about a video no one asked about: its prefill runs once (one miss,
    five hits), in the prefill thread, and every answer is the CLI's."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from media_fixtures import make_video

    base, _ = server
    clip = make_video(tmp_path / "fresh.mp4", n=8)
    url, questions = data_url(clip), QUESTIONS[:3] * 2
    misses, hits = metric(base, "hybridkv_prefix_cache_misses_total"), metric(base, "hybridkv_prefix_cache_hits_total")
    ask = lambda q: client.chat.completions.create(model="demo", messages=video_message(url, q))  # noqa: E731
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(ask, questions))
    assert metric(base, "hybridkv_prefix_cache_misses_total") == misses + 1
    assert metric(base, "hybridkv_prefix_cache_hits_total") == hits + 5
    assert sum(not r.model_extra["hybridkv"]["prefix_cache_hit"] for r in replies) == 1
    from hybridkv_cli.runs.inputs import Item
    from hybridkv_cli.runs.requests import Request
    from hybridkv_cli.runs.session import AskOptions, Session

    cli = Session(AskOptions(model="demo", defer_question=True, max_new_tokens=32))
    answers = {a.index: a.record["answer"] for a in cli.answer([Request(questions=tuple(QUESTIONS[:3]),
                                                                        item=Item((str(clip),)), shared=True)])}
    assert [r.choices[0].message.content for r in replies] == [answers[i % 3] for i in range(6)]


def test_prefixes_beyond_the_devices_share_wait_in_host_memory_and_answer_the_same(server):
    """--prefix-cache-device-bytes: a prefix beyond the device's share is parked in host memory,
    and the next question about its video copies it back (no prefill) and gets the CLI's answer."""
    from hybridkv_cli.runs.session import AskOptions, Session
    from hybridkv_cli.serve.settings import ServeSettings

    _, expected = server
    session = Session(AskOptions(model="demo", defer_question=True, max_new_tokens=32))
    settings = ServeSettings(model_id="demo", prefix_cache_device_bytes=1)  # no prefix stays on the device
    with serving(session, settings) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        infos = []
        for question in QUESTIONS[:3]:
            reply = client.chat.completions.create(model="demo", messages=video_message(data_url(NEEDLE), question))
            assert reply.choices[0].message.content == expected[(NEEDLE.name, question)]
            infos.append(reply.model_extra["hybridkv"])
        counts = {name: metric(base, f"hybridkv_prefix_cache_{name}", None)
                  for name in ("misses_total", "host_hits_total", "parks_total", "device_bytes", "entries")}
    assert [(i["prefix_cache_hit"], i["prefix_cache_tier"]) for i in infos] == [(False, None), (True, "host"),
                                                                               (True, "host")]
    assert counts == {"misses_total": 1, "host_hits_total": 2, "parks_total": 3, "device_bytes": 0, "entries": 1}


@contextmanager
def held_prefills(count: int):
    """A served demo model whose first ``count`` prefills each wait for their own event. Yields a
    namespace: ``base`` (URL), ``ask(path, question)`` (the answer), ``events`` ("load": media
    decoded, "prefill"), ``releases`` (the events), ``until(condition)``, ``queued()`` (/health's)."""
    from types import SimpleNamespace

    from hybridkv_cli.runs.session import AskOptions, Session
    from hybridkv_cli.serve.settings import ServeSettings

    session = Session(AskOptions(model="demo", defer_question=True, max_new_tokens=32))
    events, releases = [], [threading.Event() for _ in range(count)]
    load, compress = session.load_media, session.compress_prepared

    def loading(paths):
        events.append("load")
        return load(paths)

    def held(prepared, policy=None):
        events.append("prefill")
        n = events.count("prefill") - 1
        assert n >= count or releases[n].wait(30)
        return compress(prepared, policy)

    session.load_media, session.compress_prepared = loading, held

    def until(condition):
        deadline = time.monotonic() + 30
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert condition(), events

    with serving(session, ServeSettings(model_id="demo")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        ask = lambda path, question: client.chat.completions.create(  # noqa: E731
            model="demo", messages=video_message(data_url(path), question)).choices[0].message.content
        yield SimpleNamespace(base=base, ask=ask, events=events, releases=releases, until=until,
                              queued=lambda: httpx.get(base + "/health").json()["queued"])


def test_the_next_videos_media_is_decoded_while_one_is_prefilled(server):
    """The media thread decodes the next request's video while the prefill thread holds the first
    (here held on purpose); both then get the CLI's answers."""
    _, expected = server
    with held_prefills(1) as h, ThreadPoolExecutor(2) as pool:
        first = pool.submit(h.ask, NEEDLE, QUESTIONS[0])
        h.until(lambda: h.events == ["load", "prefill"])
        second = pool.submit(h.ask, SHAPES, SHAPES_QUESTION)
        h.until(lambda: h.events == ["load", "prefill", "load"])  # decoded while the first is in its prefill
        h.releases[0].set()
        assert first.result() == expected[(NEEDLE.name, QUESTIONS[0])]
        assert second.result() == expected[(SHAPES.name, SHAPES_QUESTION)]
        assert h.events == ["load", "prefill", "load", "prefill"]


def test_a_request_waiting_for_its_medias_prefix_is_not_held_up_by_other_media(server):
    """A second request about a video being prefilled waits for that prefill alone: it is answered
    the moment its prefix is made, while the next video's prefill (queued before it) still runs."""
    _, expected = server
    with held_prefills(2) as h, ThreadPoolExecutor(3) as pool:
        first = pool.submit(h.ask, NEEDLE, QUESTIONS[0])
        h.until(lambda: h.events == ["load", "prefill"])
        other = pool.submit(h.ask, SHAPES, SHAPES_QUESTION)
        h.until(lambda: h.events == ["load", "prefill", "load"] and h.queued() == 1)
        again = pool.submit(h.ask, NEEDLE, QUESTIONS[1])  # waits for the first's prefix
        h.until(lambda: h.queued() == 2)
        h.releases[0].set()
        assert again.result(30) == expected[(NEEDLE.name, QUESTIONS[1])]
        assert h.events == ["load", "prefill", "load", "prefill"] and not other.done()  # the other still held
        h.releases[1].set()
        assert first.result() == expected[(NEEDLE.name, QUESTIONS[0])]
        assert other.result() == expected[(SHAPES.name, SHAPES_QUESTION)]
        assert metric(h.base, "hybridkv_prefix_cache_misses_total", None) == 2
        assert metric(h.base, "hybridkv_prefix_cache_hits_total", None) == 1


def test_a_prefix_whose_first_client_left_is_still_made_for_the_requests_waiting_for_it(server):
    """The request that would make a video's prefix is cancelled while it waits for the prefill
    thread; another request about the video waits for that prefix: it is made (once) and answered."""
    _, expected = server
    with held_prefills(2) as h, ThreadPoolExecutor(3) as pool:
        first = pool.submit(h.ask, NEEDLE, QUESTIONS[0])
        h.until(lambda: h.events == ["load", "prefill"])
        body = {"model": "demo", "messages": video_message(data_url(SHAPES), SHAPES_QUESTION)}
        leaving = pool.submit(httpx.post, h.base + "/v1/chat/completions", json=body,
                              timeout=httpx.Timeout(60, read=3))  # its client leaves after 3 s
        h.until(lambda: h.events == ["load", "prefill", "load"] and h.queued() == 1)
        again = pool.submit(h.ask, SHAPES, SHAPES_QUESTION)  # waits for the leaving client's prefix
        h.until(lambda: h.queued() == 2)
        with pytest.raises(httpx.ReadTimeout):
            leaving.result()
        time.sleep(1.0)  # the server sees the connection closed
        h.releases[0].set()
        h.releases[1].set()
        assert first.result() == expected[(NEEDLE.name, QUESTIONS[0])]
        assert again.result(30) == expected[(SHAPES.name, SHAPES_QUESTION)]
        assert h.events == ["load", "prefill", "load", "prefill"]
        assert metric(h.base, "hybridkv_cancelled_total", None) == 1


def test_prefixes_outlive_the_server_in_the_prefix_cache_dir(server, tmp_path):
    """--prefix-cache-dir: the prefix one server made is written when it stops and read from its
    .hkv file by the next (no prefill; the CLI's answer); a file that fails its checks is removed
    and made again; the folder keeps within its bytes."""
    from hybridkv_cli.engine.hkv import intact
    from hybridkv_cli.runs.session import AskOptions, Session
    from hybridkv_cli.serve.settings import ServeSettings

    _, expected = server
    folder = tmp_path / "prefixes"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a prefix")  # other files are left alone
    session = Session(AskOptions(model="demo", defer_question=True, max_new_tokens=32))
    url = data_url(NEEDLE)

    def run(question, **limits):  # one server's life: (answer, its hybridkv info, its metrics)
        settings = ServeSettings(model_id="demo", prefix_cache_dir=str(folder), **limits)
        with serving(session, settings) as base:
            reply = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60) \
                .chat.completions.create(model="demo", messages=video_message(url, question))
            counts = {name: metric(base, f"hybridkv_prefix_cache_{name}", None)
                      for name in ("misses_total", "disk_hits_total", "disk_refused_total")}
        assert reply.choices[0].message.content == expected[(NEEDLE.name, question)]
        return reply.model_extra["hybridkv"], reply.usage, counts

    info, _, counts = run(QUESTIONS[0])
    assert info["prefix_cache_hit"] is False and counts["misses_total"] == 1
    [kept] = folder.glob("*.hkv")  # written by the time the server stopped
    info, usage, counts = run(QUESTIONS[1])  # a new server: its memory is empty, the file is read
    assert info["prefix_cache_hit"] is True and info["prefix_cache_tier"] == "disk"
    assert counts == {"misses_total": 0, "disk_hits_total": 1, "disk_refused_total": 0}
    assert usage.prompt_tokens_details.cached_tokens > info["input"]["visual_tokens"]
    size = kept.stat().st_size
    kept.write_bytes(kept.read_bytes()[: size // 2])  # cut short: refused, removed, made and written again
    info, _, counts = run(QUESTIONS[2])
    assert info["prefix_cache_hit"] is False and counts == {"misses_total": 1, "disk_hits_total": 0,
                                                            "disk_refused_total": 1}
    assert intact(kept)
    run(QUESTIONS[0], prefix_cache_dir_bytes=size // 2)  # a cap below one prefix: the folder keeps none
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "notes.txt"]
    from hybridkv_cli.io.errors import UsageError
    from hybridkv_cli.serve.prefix_store import PrefixStore

    store = PrefixStore(folder, 2**20, session.model())
    with pytest.raises(UsageError, match="in use by another hybridkv serve"):  # one server per folder
        PrefixStore(folder, 2**20, session.model())
    store.stop(1)
    PrefixStore(folder, 2**20, session.model()).stop(1)


# --- refusals: each one JSON error, and the server answers after it -----------------------------------
def _post(base, body=None, *, key=KEY, raw: bytes | None = None, path="/v1/chat/completions"):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(base + path, content=raw if raw is not None else json.dumps(body), headers=headers, timeout=60)


def _good(url=None, question="What colour is the star?", **extra):
    return {"model": "demo", "messages": video_message(url or "needle.mp4", question), **extra}


REFUSALS = {
    "dot-dot escape": (lambda: _good("../secret.mp4"), 400, "file_not_allowed"),
    "symlink out": (lambda: _good("link.mp4"), 400, "file_not_allowed"),
    "/etc/passwd": (lambda: _good("file:///etc/passwd"), 400, "file_not_allowed"),
    "http url": (lambda: _good("http://127.0.0.1:1/clip.mp4"), 400, "unsupported_url"),
    "data url not media": (lambda: _good("data:video/mp4;base64," + base64.b64encode(b"hello" * 20).decode()), 400,
                           "invalid_media"),
    "image part with a video": (lambda: {"model": "demo", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(NEEDLE, "image/png")}},
        {"type": "text", "text": "?"}]}]}, 400, "invalid_media"),
    "undecodable video": (lambda: _good("broken.mp4"), 422, "invalid_media"),
    "a video beside an image": (lambda: {"model": "demo", "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "needle.mp4"}},
        {"type": "image_url", "image_url": {"url": data_url(IMAGES[0], "image/png")}},
        {"type": "text", "text": "?"}]}]}, 400, None),
    "an audio part": (lambda: {"model": "demo", "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, {"type": "text", "text": "?"}]}]},
        400, None),
    "unknown field": (lambda: _good(logit_bias_typo=1), 400, "unknown_parameter"),
    "10k messages": (lambda: {"model": "demo", "messages": [{"role": "user", "content": "hi"}] * 10_000}, 400, None),
    "max_tokens over the context": (lambda: _good(max_tokens=40_000), 400, "context_length_exceeded"),
    "max_tokens beside the prompt": (lambda: _good(max_tokens=32_700), 400, "context_length_exceeded"),
    "too many choices": (lambda: _good(n=17), 400, None),
    "no choice": (lambda: _good(n=0), 400, None),
    "a penalty over 2": (lambda: _good(frequency_penalty=2.5), 400, None),
    "temperature above 2": (lambda: _good(temperature=2.5), 400, None),
    "top_p of 0": (lambda: _good(temperature=1, top_p=0), 400, None),
    "bad budget": (lambda: _good(hybridkv={"method": "snapkv", "budget": 1.5}), 400, None),
    "unknown method": (lambda: _good(hybridkv={"method": "os.system"}), 400, None),
    "another model": (lambda: {**_good(), "model": "gpt-4"}, 404, "model_not_found"),
    "a system turn after the user's": (lambda: {"model": "demo", "messages": [
        *video_message("needle.mp4", "?"), {"role": "system", "content": "be brief"}]}, 400, None),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_are_json_errors_and_the_server_goes_on(server, case):
    base, _ = server
    body, status, code = REFUSALS[case]
    r = _post(base, body())
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and "Traceback" not in r.text
    if code is not None:
        assert error["code"] == code, error
    assert _post(base, _good()).json()["choices"][0]["message"]["content"] == "red"


def test_a_thousand_bad_requests_leave_memory_where_it_was(server):
    """Refused requests of every stage (JSON, schema, URL, media sniffing, media decoding in the
    prefill thread) hold nothing after their answer: the process' resident memory after 1,000 of
    them is back within a few MiB of where it was after the first 200."""
    base, _ = server
    bad = [b"{not json", json.dumps(_good(logit_bias_typo=1)).encode(), json.dumps(_good("../secret.mp4")).encode(),
           json.dumps(_good("data:video/mp4;base64," + base64.b64encode(b"hello" * 2000).decode())).encode(),
           json.dumps(_good("broken.mp4")).encode()]
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    resident = lambda: int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # noqa: E731
    with httpx.Client(base_url=base, headers=headers, timeout=60) as http:
        def send(count):
            return {http.post("/v1/chat/completions", content=bad[i % len(bad)]).status_code for i in range(count)}
        assert send(200) == {400, 422}
        before = resident()
        assert send(1000) == {400, 422}
        after = resident()
        assert http.post("/v1/chat/completions", json=_good()).json()["choices"][0]["message"]["content"] == "red"
    assert after - before < 8 * 2**20, (before, after)


def test_a_client_that_sends_its_body_slowly_gets_408_and_holds_nothing(server):
    """A body that has not all arrived within --body-timeout (2 s here) is a 408 in OpenAI's error
    shape; the server answers others meanwhile and after."""
    base, _ = server
    host, port = base.removeprefix("http://").split(":")
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=30) as slow:
        slow.sendall(head + b'{"model": ')  # and then nothing
        started = time.monotonic()
        assert _post(base, _good()).json()["choices"][0]["message"]["content"] == "red"  # not held up
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            part = slow.recv(4096)
            if not part:
                break
            reply += part
    waited = time.monotonic() - started
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and 1.5 < waited < 15, (head, waited)
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert _post(base, _good()).json()["choices"][0]["message"]["content"] == "red"


def test_an_unexpected_failure_is_a_500_without_its_details(server, monkeypatch, caplog):
    base, _ = server

    def broken(*args, **kwargs):
        raise RuntimeError("secret detail")

    monkeypatch.setattr("hybridkv_cli.runs.session.Session.question_job", broken)
    r = _post(base, _good())
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "secret" not in r.text and "Traceback" not in r.text
    assert "secret detail" in caplog.text  # the server's log keeps it
    monkeypatch.undo()
    assert _post(base, _good()).json()["choices"][0]["message"]["content"] == "red"


def test_key_size_json_and_route_errors(server):
    base, _ = server
    for key in ("wrong", None):
        r = _post(base, _good(), key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(base + "/v1/models").status_code == 401
    assert httpx.get(base + "/metrics").status_code == 401
    r = _post(base, raw=b'{"model": "demo", "pad": "' + b"x" * (2**20 + 10) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = _post(base, raw=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(base + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    models = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in models["data"]] == ["demo"]
    assert httpx.get(base + "/health").json()["status"] == "ok"
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("hybridkv_requests_total", "hybridkv_generated_tokens_total", "hybridkv_tokens_per_second",
                 "hybridkv_kv_device_bytes", "hybridkv_queue_length"):
        assert f"# TYPE {name} " in text
    assert re.search(r'^hybridkv_requests_total\{status="401"\} [1-9]', text, re.M)


def test_a_client_that_leaves_is_cancelled_and_a_full_queue_is_503():
    """demo-random rarely ends an answer: a request for 3000 tokens runs until its client leaves.
    One member at a time and one waiting: a third request finds the queue full."""
    from hybridkv_cli.runs.session import AskOptions, Session
    from hybridkv_cli.serve.settings import ServeSettings

    session = Session(AskOptions(model="demo-random", defer_question=True))
    with serving(session, ServeSettings(model_id="demo-random", max_batch=1, queue_size=1)) as base:
        body = {**_good(data_url(NEEDLE)), "model": "demo-random", "max_tokens": 3000}
        url = base + "/v1/chat/completions"
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            stream = r.iter_lines()  # kept open: closing the iterator closes the connection
            lines = [line for line in (next(stream) for _ in range(6)) if line]
            assert all(line.startswith("data: {") for line in lines)
            waiting = ThreadPoolExecutor(1).submit(httpx.post, url, json=body, timeout=3.0)  # queued behind it
            deadline = time.monotonic() + 10
            while httpx.get(base + "/health").json()["queued"] < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            full = httpx.post(url, json=body, timeout=60)
            assert full.status_code == 503 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "queue_full"
        with pytest.raises(httpx.ReadTimeout):  # decoded once the stream left, until its client gave up
            waiting.result()
        deadline = time.monotonic() + 20
        while metric(base, "hybridkv_cancelled_total", None) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(base, "hybridkv_cancelled_total", None) == 2
        assert metric(base, "hybridkv_decoding_requests", None) == 0
        assert metric(base, "hybridkv_generated_tokens_total", None) < 2000  # of the 6000 asked for
        short = httpx.post(url, json={**body, "max_tokens": 4}, timeout=60).json()
        assert short["usage"]["completion_tokens"] == 4 and short["choices"][0]["finish_reason"] == "length"


# --- pieces --------------------------------------------------------------------------------------
def test_the_engine_takes_a_live_source_stops_members_and_keeps_each_jobs_limit():
    """What the worker relies on: ``decode`` over a source that sometimes has nothing waiting
    (None), a ``watch`` that stops a member after a step, and a job's own ``max_new_tokens``; the
    others' tokens stay those of their runs alone."""
    from hybridkv_cli.engine import Limits, decode
    from hybridkv_cli.runs.inputs import Item
    from hybridkv_cli.runs.requests import Request
    from hybridkv_cli.runs.session import AskOptions, Session

    session = Session(AskOptions(model="demo-random", defer_question=True, max_new_tokens=8))
    prefix = session.compress(Item((str(NEEDLE),)))
    model = lambda: session.model().model
    questions = ["What colour is the star?", "Which shape appears first?"]
    job = lambda q, tag, limit=None: session.question_job(prefix, Request(questions=(q,), prefix=prefix,
                                                                          max_new_tokens=limit), 0, tag=tag)
    alone = [next(iter(decode(model, [(0, lambda q=q: job(q, 0))], max_new_tokens=8)))
             .generation.tokens for q in questions]
    assert all(len(tokens) > 3 for tokens in alone)

    def source():
        yield 0, lambda: job(questions[0], 0)
        yield None  # nothing waiting: the member decodes a step, and the source is asked again
        yield None
        yield 1, lambda: job(questions[1], 1, 3)

    stopped = lambda members: [m for m in members if m.job.tag == 0 and len(m.tokens) >= 2]
    got = {o.job.tag: o.generation.tokens for o in decode(model, source(), max_new_tokens=8,
                                                         limits=Limits(batch_size=4), watch=stopped)}
    assert got == {0: alone[0][:2], 1: alone[1][:3]}


def test_answer_text_streams_a_prefix_of_the_final_text_and_cuts_at_stop():
    from hybridkv_cli.serve.answer_text import AnswerText

    words = ["  The", " star", " is", " red", ".", " END", " more"]
    decode = lambda ids: "".join(words[i] for i in ids)
    text = AnswerText(decode, stop=(" END",))
    given = "".join(text.update(list(range(n))) for n in range(1, len(words) + 1))
    assert text.stopped and given == "The star is red." and text.finish(list(range(len(words)))) == ""
    held = AnswerText(decode, stop=("red.",))
    assert held.update([0, 1, 2, 3]) == "The star is"  # " red" may begin the stop string: held back
    assert held.update([0, 1, 2, 3, 4]) == "" and held.stopped and held.final([0, 1, 2, 3, 4]) == "The star is"


@dataclass
class KeptStub:
    """A prefix as the cache sees it: its bytes, and whether it is parked."""
    device_bytes: int
    host_bytes: int
    parked: bool = False

    def park(self):
        return KeptStub(self.device_bytes, self.host_bytes, True)

    def unpark(self):
        return KeptStub(self.device_bytes, self.host_bytes, False)


def test_prefix_cache_keeps_within_its_bytes_least_recently_used_first():
    from hybridkv_cli.serve.prefix_cache import PrefixCache, prefix_key

    cache = PrefixCache(capacity=100)
    p = lambda n: KeptStub(n, n)
    assert cache.put("a", p(20)) and cache.put("b", p(20)) and cache.get("a") is not None
    assert cache.put("c", p(20))  # 120 > 100: "b", the least recently used, goes
    assert cache.get("b") is None and cache.get("a") is not None and cache.bytes == 80 and cache.device_bytes == 40
    assert not cache.put("huge", p(60)) and len(cache) == 2
    key = lambda **kw: prefix_key(**{"model": "demo", "method": "hybridkv", "options": {"budget": 0.1},
                                     "sampling": {"frames": 64}, "media_digests": [("video", "ab")],
                                     "context": None, **kw})
    assert key() == key() and len({key(), key(options={"budget": 0.2}), key(media_digests=[("video", "cd")]),
                                   key(model="other"), key(sampling={"frames": 32}), key(system="be brief"),
                                   key(context="text")}) == 7


def test_prefix_cache_parks_beyond_the_devices_share_and_copies_back_on_a_hit():
    from hybridkv_cli.serve.prefix_cache import PrefixCache

    cache = PrefixCache(capacity=1000, device_capacity=25)
    for key in "abc":
        assert cache.put(key, KeptStub(10, 90))
    # 30 device bytes > 25: "a", the least recently used, went to host memory; all are still kept
    assert [cache.get(k, count=False).parked for k in "bca"] == [False, False, True]
    assert cache.device_bytes == 20 and cache.bytes == 300 and cache.parks == 1 and len(cache) == 3
    back = cache.unparked("a", cache.get("a"))  # a hit on it: copied back, and "b" (now the oldest) parked
    assert not back.parked and cache.get("a", count=False) is back and cache.get("b", count=False).parked
    assert cache.device_bytes == 20 and cache.unparks == 1 and cache.parks == 2
    cache.put("d", KeptStub(10, 700))  # over 1000 bytes: the least recently used ("c": b was just read) evicted
    assert cache.get("c") is None and cache.evictions == 1 and cache.bytes == 910 and cache.device_bytes == 20


def test_the_servers_torch_threads_never_outnumber_the_cores():
    from hybridkv_cli.serve.settings import intra_op_threads

    # its three computing threads (decoding, prefill, media) each run a team of this many
    assert [intra_op_threads(None, cores, env_set=False) for cores in (1, 2, 3, 8, 16)] == [1, 1, 1, 2, 5]
    assert intra_op_threads(None, 16, env_set=True) is None  # $OMP_NUM_THREADS chose: torch has read it
    assert intra_op_threads(4, 2, env_set=True) == 4  # --threads wins


@pytest.mark.slow
def test_the_command_starts_fast_and_answers(tmp_path):
    from hybridkv_cli.serve.settings import intra_op_threads, usable_cores

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the server's own choice
    team = intra_op_threads(None, usable_cores(), env_set=False)
    bad = subprocess.run([sys.executable, "-m", "hybridkv_cli.cli", "serve", "--model", "demo",
                          "--allowed-media-dir", str(tmp_path / "missing")], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "--allowed-media-dir" in bad.stderr and "Traceback" not in bad.stderr
    (tmp_path / "file").write_text("")
    bad = subprocess.run([sys.executable, "-m", "hybridkv_cli.cli", "serve", "--model", "demo",
                          "--prefix-cache-dir", str(tmp_path / "file")], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "--prefix-cache-dir" in bad.stderr and "Traceback" not in bad.stderr
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv_cli.cli", "serve", "--model", "demo", "--port",
                             str(port), "--served-model-name", "video-qa"], stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        while time.perf_counter() - started < 30:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        ready = time.perf_counter() - started
        assert ready < 20, ready  # 5-7 s alone (docs/serve.md); room for a suite running beside it
        base = f"http://127.0.0.1:{port}"
        for name in ("hybridkv_prefix_cache_entries", "hybridkv_prefix_cache_misses_total",
                     "hybridkv_generated_tokens_total"):  # its warm-up request left nothing behind
            assert metric(base, name, key=None) == 0, name
        # what start-up made is out of the collector's full scans (~0.5M objects: ~190 ms each, docs/serve.md)
        assert metric(base, "hybridkv_gc_frozen_objects", key=None) > 100_000
        text = httpx.get(base + "/metrics").text
        assert all(f'python_gc_collections_total{{generation="{g}"}}' in text for g in range(3)), text
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        r = httpx.post(url, json={**_good(data_url(NEEDLE)), "model": "video-qa"}, timeout=60)  # the served name
        assert r.json()["choices"][0]["message"]["content"] == "red" and r.json()["model"] == "video-qa"
        assert httpx.post(url, json=_good(data_url(NEEDLE)), timeout=60).status_code == 404  # not the path's
    finally:
        proc.terminate()
        assert proc.wait(15) == 0
    log = " ".join(proc.stderr.read().split())  # (the console wraps its lines)
    assert "warmed up in" in log and "warm-up request failed" not in log, log
    assert f"{team} torch thread{'s' if team > 1 else ''} per computing thread" in log, log
