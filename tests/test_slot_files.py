"""llama-server's slot files over the prefix cache: what a slot last held, saved and restored in
this scheduler or a new one (another process's), erased; on the fake engine, whose "model"
reads every token through the page tables, and through POST /slots/{id} on the tiny model's
server, whose answers after a restore equal the first ones to the logprob."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cadence.scheduler.slot_files import FORMAT, SlotFile, forget
from tests.fakes import FakeEngine, Harness, chunked, random_prompt

NAMESPACE = "fake-model"


def harness(**config) -> Harness:
    engine = FakeEngine(num_slots=2, prefill_chunk=32, max_seq_len=128, page_size=8, num_pages=33)
    h = Harness(engine, chunked(budget=64, chunk=32), cache_namespace=NAMESPACE, **config)
    engine.frozen = h.sched.pools[0].pages.published
    return h


def on_loop(h: Harness, fn):
    """`fn` through the scheduler's loop, as the server calls it: queued, then one step."""
    future = h.sched.call_in_loop(fn)
    h.step()
    return future.result(timeout=0)


def serve(h: Harness, prompt, **params):
    client = h.submit(prompt, max_tokens=6, ignore_eos=True, **params)
    h.run()
    client.check(h.engine)
    return client


def test_a_saved_slot_restores_into_another_scheduler_and_is_hit(tmp_path):
    """A 100-token prompt and its 6 tokens leave slot 0 holding 105 tokens of KV, 13 whole
    pages: saved, they restore into a fresh scheduler (as another process would), where the
    same prompt computes only its last token and gives the same output."""
    h = harness()
    prompt = random_prompt(np.random.default_rng(1), 100)
    first = serve(h, prompt)
    saved = on_loop(h, lambda: SlotFile.take(h.sched.pools[0], first.slot, NAMESPACE))
    assert len(saved.tokens) == 104 and saved.tokens == (prompt + first.token_ids)[:104]
    size = saved.write(tmp_path / "a.bin")
    assert size == (tmp_path / "a.bin").stat().st_size > 104 * 8

    fresh = harness()
    loaded = SlotFile.read(tmp_path / "a.bin")
    assert on_loop(fresh, lambda: loaded.restore(fresh.sched.pools[0], NAMESPACE)) == 104
    pages = fresh.sched.pools[0].pages
    assert pages.cached_count == 13 and pages.used_count == 0  # cached, nobody's
    pages.check()
    again = serve(fresh, prompt)
    # 12 whole pages, and the 13th's first 4 positions copied: all but the prompt's last token.
    assert again.record.cached_tokens == 99 and again.token_ids == first.token_ids
    # Restoring again finds every page cached already and writes nothing.
    inserts = fresh.engine.inserts
    assert on_loop(fresh, lambda: loaded.restore(fresh.sched.pools[0], NAMESPACE)) == 104
    assert fresh.engine.inserts == inserts


def test_restoring_into_a_busy_pool_restores_what_fits_and_keeps_the_run_whole(tmp_path):
    """While a request holds most of the pool, and a shorter prompt left the file's first 3
    pages cached: those are held while the growth evicts, and as many pages as the free ones
    hold follow them, so the keys find the whole run from the first page."""
    from cadence.scheduler.pages import PageKeys

    h = harness()
    prompt = random_prompt(np.random.default_rng(2), 100)
    first = serve(h, prompt)
    on_loop(h, lambda: SlotFile.take(h.sched.pools[0], first.slot, NAMESPACE)).write(tmp_path / "b.bin")
    loaded = SlotFile.read(tmp_path / "b.bin")
    engine = FakeEngine(num_slots=2, prefill_chunk=32, max_seq_len=128, page_size=8, num_pages=18)
    busy = Harness(engine, chunked(budget=64, chunk=32), cache_namespace=NAMESPACE)
    engine.frozen = busy.sched.pools[0].pages.published
    serve(busy, prompt[:24])  # 3 whole pages of the file's, and a partly written one
    hog = busy.submit(random_prompt(np.random.default_rng(3), 60), max_tokens=20, ignore_eos=True)
    busy.run(until=lambda: len(hog.token_ids) > 0)
    pages = busy.sched.pools[0].pages
    fits = min(13 - 3, pages.free_count - 3)  # (the 3 cached ones are among the free count)
    assert 0 < fits < 10
    # (on this thread: nothing else runs on the harness's scheduler between its steps)
    assert loaded.restore(busy.sched.pools[0], NAMESPACE) == (3 + fits) * 8
    pages.check()
    assert len(pages.lookup(PageKeys(8, NAMESPACE.encode()).upto(loaded.tokens, 13))) == 3 + fits
    busy.run()
    for c in busy.clients:
        c.check(engine)


def test_erasing_a_slot_drops_its_pages_from_both_tiers():
    """Slot 0's sequence ends; a longer one in slot 1 then evicts most of its pages to the host
    tier. Erasing slot 0 drops the rest from the device's cache and its pages from the host's,
    and the prompt is computed again."""
    from cadence.scheduler.pages import PageKeys

    engine = FakeEngine(num_slots=2, prefill_chunk=32, max_seq_len=128, page_size=8, num_pages=18)
    h = Harness(engine, chunked(budget=64, chunk=32), cache_namespace=NAMESPACE, host_kv_cache_bytes=10_000)
    engine.frozen = h.sched.pools[0].pages.published
    prompt = random_prompt(np.random.default_rng(4), 100)
    first = h.submit(prompt, max_tokens=6, ignore_eos=True)
    h.run(until=lambda: len(first.token_ids) > 0)
    other = h.submit(random_prompt(np.random.default_rng(5), 20), max_tokens=100, ignore_eos=True)
    h.run()
    assert (first.slot, other.slot) == (0, 1)
    pool = h.sched.pools[0]
    wanted = PageKeys(8, NAMESPACE.encode()).upto(prompt + first.token_ids, 13)
    on_device = pool.pages.lookup(wanted)
    assert 0 < len(on_device) < 13 and len(pool.host.lookup(wanted[len(on_device) :])) == 13 - len(on_device)
    assert on_loop(h, lambda: forget(pool, 0)) == 105  # 13 whole pages and 1 token
    assert pool.pages.lookup(wanted) == [] and not any(key in pool.host for key in wanted)
    assert on_loop(h, lambda: forget(pool, 0)) == 0  # nothing left to erase
    assert serve(h, prompt).record.cached_tokens == 0
    pool.pages.check()


def test_what_a_file_cannot_restore_is_refused(tmp_path):
    h = harness()
    prompt = random_prompt(np.random.default_rng(5), 40)
    first = serve(h, prompt)
    saved = on_loop(h, lambda: SlotFile.take(h.sched.pools[0], first.slot, NAMESPACE))
    pool = h.sched.pools[0]
    with pytest.raises(ValueError, match="holds the KV of 'fake-model'; this server's is 'other'"):
        on_loop(h, lambda: saved.restore(pool, "other"))
    other = FakeEngine(num_slots=2, prefill_chunk=32, max_seq_len=128, page_size=4)
    small = Harness(other, chunked(budget=64, chunk=32), cache_namespace=NAMESPACE)
    with pytest.raises(ValueError, match="in pages of 8; this server holds up to 128 in pages of 4"):
        on_loop(small, lambda: saved.restore(small.sched.pools[0], NAMESPACE))
    wide = SlotFile(NAMESPACE, None, 8, saved.tokens, [(np.zeros(16, np.int64),) for _ in saved.pages])
    with pytest.raises(ValueError, match="the file's pages are"):
        on_loop(h, lambda: wide.restore(pool, NAMESPACE))
    for junk in (b"not a file of ours", b"", b"PK\x03\x04 cut short"):
        (tmp_path / "junk.bin").write_bytes(junk)
        with pytest.raises(ValueError, match="junk.bin is not a slot file"):
            SlotFile.read(tmp_path / "junk.bin")
    for meta, why in [({"page_size": "8"}, "malformed"), ({"tokens": [2**63] * 8}, "malformed"),
                      ({"tokens": [1, 2, 3]}, "tokens and pages disagree"),
                      ({"format": "other"}, "not a slot file of this version")]:
        description = {"format": FORMAT, "namespace": NAMESPACE, "salt": None, "page_size": 8, "tokens": [],
                       "dtypes": [], **meta}
        with open(tmp_path / "bad.bin", "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(description).encode(), np.uint8))
        with pytest.raises(ValueError, match=f"bad.bin is not a slot file: .*{why}"):
            SlotFile.read(tmp_path / "bad.bin")
    empty = on_loop(h, lambda: SlotFile.take(pool, 1, NAMESPACE))  # slot 1 held nothing yet
    assert empty.tokens == [] and empty.pages == []
    empty.write(tmp_path / "empty.bin")
    assert on_loop(h, lambda: SlotFile.read(tmp_path / "empty.bin").restore(pool, NAMESPACE)) == 0


def test_a_restore_whose_insert_fails_gives_its_pages_back(tmp_path):
    """The engine fails mid-restore: the error reaches the caller, every page it took is back
    (nothing published), and the scheduler goes on serving."""
    h = harness()
    prompt = random_prompt(np.random.default_rng(8), 60)
    first = serve(h, prompt)
    saved = on_loop(h, lambda: SlotFile.take(h.sched.pools[0], first.slot, NAMESPACE))
    fresh = harness()
    fresh.engine.fail_insert_call = 1
    pool = fresh.sched.pools[0]
    with pytest.raises(RuntimeError, match="device lost in insert"):
        on_loop(fresh, lambda: saved.restore(pool, NAMESPACE))
    pool.pages.check()
    assert pool.pages.used_count == 0 and pool.pages.cached_count == 0
    assert serve(fresh, prompt).record.cached_tokens == 0


def test_a_call_whose_caller_gave_up_is_not_run():
    """A `call_in_loop` future cancelled before the loop reaches it (its HTTP handler was
    cancelled) is skipped; the calls after it run, and nothing fails."""
    h = harness()
    ran = []
    gone = h.sched.call_in_loop(lambda: ran.append("gone"))
    kept = h.sched.call_in_loop(lambda: ran.append("kept") or 7)
    assert gone.cancel()
    client = h.submit(random_prompt(np.random.default_rng(9), 20), max_tokens=4, ignore_eos=True)
    h.run()
    client.check(h.engine)
    assert ran == ["kept"] and kept.result(timeout=0) == 7


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_a_file_keeps_the_pools_dtype_bit_for_bit(tmp_path, dtype):
    """NumPy's files know no bfloat16 or float8: the pages go as unsigned ints of their width
    and come back as they were."""
    import ml_dtypes

    rng = np.random.default_rng(7)
    kind = np.dtype(getattr(ml_dtypes, dtype, dtype))
    pages = [tuple(rng.normal(size=(2, 3, 8, 4)).astype(kind) for _ in range(2)) for _ in range(3)]
    SlotFile(NAMESPACE, "salt", 8, list(range(24)), pages).write(tmp_path / "d.bin")
    back = SlotFile.read(tmp_path / "d.bin")
    assert (back.namespace, back.salt, back.page_size, back.tokens) == (NAMESPACE, "salt", 8, list(range(24)))
    for theirs, ours in zip(pages, back.pages):
        for a, b in zip(theirs, ours):
            assert b.dtype == kind and b.tobytes() == a.tobytes()


# --- the server ----------------------------------------------------------------------------------


def test_slot_actions_over_http_save_erase_and_restore(tiny_engine, tiny_tokenizer, tmp_path):
    """POST /slots/0?action=save, erase, restore on the tiny model's server: after the erase
    the prompt finds nothing cached; after the restore it finds its whole pages, and its
    answer and 5 alternatives' logprobs are the first answer's (within 1e-4)."""
    import httpx

    from tests.conftest import loopback_server, tiny_app

    app, sched = tiny_app(tiny_engine, tiny_tokenizer, slot_save_path=str(tmp_path))
    prompt = [int(t) for t in np.random.default_rng(6).integers(3, 200, 150)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 5,
            "ignore_eos": True}

    def complete(client):
        answer = client.post("/v1/completions", json=body).json()
        choice = answer["choices"][0]
        return (choice["text"], choice["logprobs"]["top_logprobs"],
                answer["usage"]["prompt_tokens_details"]["cached_tokens"])

    with loopback_server(app) as base, httpx.Client(base_url=base, timeout=60) as client:
        text, top, cached = complete(client)
        assert cached == 0
        (slot,) = sched.pools[0].last_sequences  # the slot the one request ran in
        saved = client.post(f"/slots/{slot}?action=save", json={"filename": "chat.bin"}).json()
        assert saved["n_saved"] == 128 and saved["n_written"] == (tmp_path / "chat.bin").stat().st_size
        assert set(saved) == {"id_slot", "filename", "n_saved", "n_written", "timings"}
        assert client.post(f"/slots/{slot}?action=erase").json() == {"id_slot": slot, "n_erased": 157}
        assert sched.pools[0].pages.cached_count == 0
        restored = client.post(f"/slots/{slot}?action=restore", json={"filename": "chat.bin"}).json()
        assert restored["n_restored"] == 128 and restored["n_read"] == saved["n_written"]
        again_text, again_top, again_cached = complete(client)
        assert again_cached == 128 and again_text == text
        for ours, theirs in zip(again_top, top):
            assert ours.keys() == theirs.keys()
            np.testing.assert_allclose([ours[k] for k in ours], [theirs[k] for k in ours], atol=1e-4)

        # llama-server's /completion names the slot a request ended in: the one to save.
        named = client.post("/completion", json={"prompt": "hi", "n_predict": 2}).json()["id_slot"]
        tokens, _ = sched.pools[0].last_sequences[named]
        assert len(tokens) < 10  # "hi" and its reply's written tokens, not the long prompt

        def error(path, **kw):
            r = client.post(path, **kw)
            return r.status_code, r.json()["error"]["message"]

        assert error("/slots/9?action=save", json={"filename": "x"})[0] == 400
        assert error("/slots/x?action=save", json={"filename": "x"})[0] == 400
        assert error(f"/slots/{slot}?action=copy", json={"filename": "x"})[0] == 400
        for name in ("../x", ".hidden", "a/b", "", None, 7):
            assert error(f"/slots/{slot}?action=save", json={"filename": name})[0] == 400
        assert error(f"/slots/{slot}?action=restore", json={"filename": "missing.bin"})[0] == 404
        (tmp_path / "junk.bin").write_bytes(b"junk")
        status, message = error(f"/slots/{slot}?action=restore", json={"filename": "junk.bin"})
        assert status == 400 and "not a slot file" in message

    app, _ = tiny_app(tiny_engine, tiny_tokenizer)  # no --slot_save_path
    with loopback_server(app) as base, httpx.Client(base_url=base, timeout=60) as client:
        r = client.post("/slots/0?action=save", json={"filename": "chat.bin"})
        assert r.status_code == 501 and "--slot_save_path" in r.json()["error"]["message"]
