"""Background responses (`background: true`, server/responses_background.py), driven by the
official SDK over loopback HTTP: the same answer as in the foreground, polled or streamed; the
events kept and streamed again from any sequence number, while it is made and once it is
stored; a dropped stream that does not stop it; "queued" until the scheduler admits it;
cancelled, deleted, and the 400s. Timing-dependent cases run over the fake engine slowed to a
known pace per decode step; answers are compared on the tiny model."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest


from tests.conftest import serve_tiny
from tests.fakes import TOK, FakeEngine

MODEL = "tiny"
TIMEOUT = httpx.Timeout(120.0, connect=5.0)
LONG = dict(max_output_tokens=400, extra_body={"ignore_eos": True})  # ~8 s at the fake's pace


@pytest.fixture(scope="module")
def client(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer, MODEL) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def slow():
    """A server over the fake engine with one slot, 20 ms a decode step; its SDK client."""
    with serve_tiny(FakeEngine(num_slots=1, max_seq_len=1024, decode_delay=0.02), TOK, MODEL) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def finished(client, response_id: str, seconds: float = 60):
    """The response polled until it leaves queued and in_progress."""
    deadline = time.monotonic() + seconds
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.02)


def until(client, response_id: str, test, seconds: float = 30):
    """The response polled until `test(response)` holds."""
    deadline = time.monotonic() + seconds
    while not test(response := client.responses.retrieve(response_id)):
        assert time.monotonic() < deadline, response
        time.sleep(0.01)
    return response


def raw_events(client, path: str) -> list[dict]:
    """The events of a GET stream, as JSON."""
    with httpx.stream("GET", f"{client.base_url}{path}", timeout=TIMEOUT) as response:
        assert response.status_code == 200, response.read()
        text = response.read().decode()
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_a_background_response_is_the_foreground_answer_polled(client):
    """Answered at once "queued", then polled to the same answer, usage and storing as the
    same request in the foreground; it chains by previous_response_id like any stored one."""
    ask = dict(model=MODEL, input="Hello there", max_output_tokens=8, temperature=0)
    expected = client.responses.create(**ask)
    queued = client.responses.create(**ask, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = finished(client, queued.id)
    assert done.status == expected.status and done.background is True
    assert done.output_text == expected.output_text
    assert done.usage.input_tokens == expected.usage.input_tokens
    assert done.usage.output_tokens == expected.usage.output_tokens
    assert [i.content[0].text for i in client.responses.input_items.list(done.id).data] == ["Hello there"]
    after = client.responses.create(model=MODEL, input="Two", max_output_tokens=2, previous_response_id=done.id)
    again = client.responses.create(model=MODEL, input="Two", max_output_tokens=2, previous_response_id=expected.id)
    assert after.usage.input_tokens == again.usage.input_tokens


def test_background_streams_are_kept_and_streamed_again_from_any_sequence_number(client):
    """Streamed at creation, the events begin response.created and response.queued (both
    "queued"), then response.in_progress, and build the foreground's answer; GET with
    stream=true gives the same events again, all of them or those after starting_after."""
    ask = dict(model=MODEL, input="Hello there", max_output_tokens=8, temperature=0)
    expected = client.responses.create(**ask)
    events = list(client.responses.create(**ask, background=True, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert events[0].response.status == events[1].response.status == "queued"
    assert kinds[-1] == "response." + expected.status
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == expected.output_text and final.background is True
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected.output_text

    sent = [e.model_dump(mode="json", exclude_unset=True) for e in events]
    path = f"responses/{final.id}?stream=true"
    assert raw_events(client, path) == sent
    for after in (0, 4, len(sent) - 2, len(sent) - 1):
        assert raw_events(client, f"{path}&starting_after={after}") == sent[after + 1:]
    resumed = list(client.responses.retrieve(final.id, stream=True, starting_after=2))
    assert [e.sequence_number for e in resumed] == list(range(3, len(events)))


def test_a_dropped_stream_goes_on_and_is_picked_up_where_it_was_left(slow):
    """A client that drops a background stream stops nothing: the response is made to its end,
    and the stream picked up after the last sequence number read gives the rest, none twice."""
    stream = slow.responses.create(model=MODEL, input="x", background=True, stream=True, max_output_tokens=60,
                                   extra_body={"ignore_eos": True})
    read = []
    for event in stream:
        read.append(event)
        if event.type == "response.output_text.delta" and len(read) > 8:
            break
    stream.close()
    rest = list(slow.responses.retrieve(read[0].response.id, stream=True, starting_after=read[-1].sequence_number))
    whole = read + rest
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    assert whole[-1].type == "response.incomplete" and whole[-1].response.usage.output_tokens == 60
    text = "".join(e.delta for e in whole if e.type == "response.output_text.delta")
    assert text == whole[-1].response.output_text == finished(slow, whole[0].response.id).output_text


def test_queued_until_admitted_and_cancelled_mid_answer(slow):
    """Behind a response that holds the one slot, a background response stays "queued" (one
    cancelled there ends "cancelled", never in progress); cancel the first mid-answer and it
    ends "cancelled" with the text made so far (again: the same), and the second is admitted
    and made to its end."""
    first = slow.responses.create(model=MODEL, input="a", background=True, **LONG)
    second = slow.responses.create(model=MODEL, input="b", background=True, max_output_tokens=5,
                                   extra_body={"ignore_eos": True})
    partial = until(slow, first.id, lambda r: r.status == "in_progress" and len(r.output_text) >= 3)
    assert partial.output[0].status == "in_progress"
    assert slow.responses.retrieve(second.id).status == "queued"
    third = slow.responses.create(model=MODEL, input="b", background=True, **LONG)
    never = slow.responses.cancel(third.id)  # (cancelled while queued: never admitted)
    assert never.status == "cancelled" and never.output_text == "" and never.usage.output_tokens == 0
    kinds = [e.type for e in slow.responses.retrieve(third.id, stream=True)]
    assert kinds[:2] == ["response.created", "response.queued"] and "response.in_progress" not in kinds
    cancelled = slow.responses.cancel(first.id)
    assert cancelled.status == "cancelled" and cancelled.output_text.startswith(partial.output_text)
    assert 3 <= cancelled.usage.output_tokens < 400 and cancelled.output[0].status == "incomplete"
    assert slow.responses.cancel(first.id).model_dump() == cancelled.model_dump()
    assert slow.responses.retrieve(first.id).model_dump() == cancelled.model_dump()
    events = list(slow.responses.retrieve(first.id, stream=True))
    assert events[-1].type == "response.output_item.done" and events[-1].item.status == "incomplete"
    done = finished(slow, second.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 5
    assert slow.responses.cancel(second.id).status == "incomplete"  # (finished: as it was)


def test_deleting_a_running_background_response_cancels_and_forgets_it(slow):
    running = slow.responses.create(model=MODEL, input="c", background=True, **LONG)
    until(slow, running.id, lambda r: r.status == "in_progress")
    with pytest.raises(openai.BadRequestError) as refused:
        slow.responses.create(model=MODEL, input="d", previous_response_id=running.id)
    assert "still being made" in refused.value.body["message"]
    assert slow.responses.delete(running.id) is None  # (the SDK returns nothing)
    with pytest.raises(openai.NotFoundError):
        slow.responses.retrieve(running.id)
    later = slow.responses.create(model=MODEL, input="e", max_output_tokens=2)  # the slot is free again
    assert later.status in ("completed", "incomplete")


def test_what_only_a_background_response_may_do_is_a_400_for_others(client):
    foreground = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    base = f"{client.base_url}responses/{foreground.id}"
    for refused in (httpx.get(f"{base}?stream=true", timeout=TIMEOUT),
                    httpx.post(f"{base}/cancel", timeout=TIMEOUT)):
        assert refused.status_code == 400 and "background" in refused.json()["error"]["message"]
    for query, param in (("stream=maybe", "stream"), ("stream=true&starting_after=x", "starting_after")):
        refused = httpx.get(f"{base}?{query}", timeout=TIMEOUT)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    assert httpx.post(f"{client.base_url}responses/resp_nope/cancel", timeout=TIMEOUT).status_code == 404
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="x", background=True, store=False)
    assert refused.value.body["param"] == "background"
