"""Embeddings: prompts prefilled in the pooling program (chunked, packed with each other and
beside requests that generate), their final hidden states pooled, against the reference's one
forward pass over the whole prompt; and the scheduler's handling of them (no token, no decode,
no prefix cache, preemption, batched generation unchanged beside them)."""

from __future__ import annotations

import base64
import json
import random

import httpx
import numpy as np
import openai
import pytest

from cadence.engine.config import EngineConfig
from cadence.engine.packing import PrefillChunk
from cadence.engine.reference import greedy_generate, sequence_logits
from cadence.model.host_sampling import SamplingRows
from cadence.scheduler.errors import RequestTooLong, SubmissionError
from cadence.scheduler.policy import PolicyConfig
from cadence.scheduler.request import GenerationParams
from cadence.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.conftest import ONE_LONGEST, SAMPLING_ENGINE, compiled, serve_tiny
from tests.fakes import random_prompts, run_all


TIMEOUT = httpx.Timeout(120.0, connect=5.0)


@pytest.fixture
def engine(shared_engine):
    # The pooling programs compiled before the test: no embedding parks for them, so the
    # schedules below do not depend on how long compiling takes.
    return compiled(shared_engine(EngineConfig(**SAMPLING_ENGINE), "needed"), "pooling")


def scheduler(engine, tokenizer, **config) -> Scheduler:
    return Scheduler(engine, tokenizer, SchedulerConfig(
        policy=PolicyConfig(name="chunked", token_budget=48, chunk=32), **config))


def reference(params, config, prompt, pooling) -> np.ndarray:
    hidden = sequence_logits(params, config, prompt, hidden=True).astype(np.float64)
    return hidden.mean(axis=0) if pooling == "mean" else hidden[-1]


def embed(pooling: str) -> GenerationParams:
    return GenerationParams(pooling=pooling)


def test_pooled_prefill_equals_the_reference_chunked_and_packed(engine, tiny_params, tiny_config):
    """The engine alone: two prompts' chunks packed in one pooling program (the second split
    in three chunks over two calls), beside a chunk that samples; each chunk's sum and last
    hidden state equal the reference's over the whole prompt."""
    rng = random.Random(0)
    a, b, c = random_prompts(rng, 3, tiny_config.vocab_size, 20, 30)
    b = b + random_prompts(rng, 1, tiny_config.vocab_size, 40, 40)[0]
    pages = engine.config.pages_for(engine.config.max_seq_len)
    tables = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(3)]
    rows = SamplingRows(engine.config.num_slots).params()  # every slot greedy
    first = engine.prefill([PrefillChunk(0, a, 0, True, tables[0], pooled=True),
                            PrefillChunk(2, c, 0, True, tables[2]),
                            PrefillChunk(1, b[:32], 0, False, tables[1], pooled=True),
                            PrefillChunk(1, b[32:48], 32, False, tables[1], pooled=True)], rows)
    second = engine.prefill([PrefillChunk(1, b[48:], 48, True, tables[1], pooled=True)], rows)
    got, rest = first.pooled(), second.pooled()
    assert sorted(got) == [0, 2, 3] and sorted(rest) == [0]
    # one token, the sampling chunk's; the pooled chunks' entries are -1
    assert np.asarray(first).tolist() == [-1, greedy_generate(tiny_params, tiny_config, c, 1)[0], -1, -1]
    hidden_a = sequence_logits(tiny_params, tiny_config, a, hidden=True)
    hidden_b = sequence_logits(tiny_params, tiny_config, b, hidden=True)
    np.testing.assert_allclose(got[0][0], hidden_a.sum(0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[0][1], hidden_a[-1], rtol=1e-4, atol=1e-5)
    parts = [got[2], got[3], rest[0]]
    for (total, last), (lo, hi) in zip(parts, [(0, 32), (32, 48), (48, len(b))]):
        np.testing.assert_allclose(total, hidden_b[lo:hi].sum(0), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(last, hidden_b[hi - 1], rtol=1e-4, atol=1e-5)


def test_embeddings_beside_generation_equal_the_reference(engine, tiny_params, tiny_config,
                                                          tiny_tokenizer):
    """Embeddings of both poolings, of prompts over several chunks, arriving among greedy
    requests: each equals the reference's pooling; the generated answers equal the reference
    generator's, as alone; an embedding emits no token and decodes nothing."""
    rng = random.Random(1)
    prompts = random_prompts(rng, 8, tiny_config.vocab_size, 3, 120)
    poolings = ["mean", None, "last", "mean", None, "last", "last", "mean"]
    subs = [(p, embed(k) if k else GenerationParams(max_tokens=10, ignore_eos=True))
            for p, k in zip(prompts, poolings)]
    before = engine.compilations_after_warmup
    streams = run_all(scheduler(engine, tiny_tokenizer), subs, [rng.randint(0, 4) for _ in subs])
    assert engine.compilations_after_warmup == before
    for prompt, pooling, s in zip(prompts, poolings, streams):
        record = s.record
        if pooling is None:
            assert record.embedding is None
            assert s.request.output_ids == greedy_generate(tiny_params, tiny_config, prompt, 10)
            continue
        assert record.finish_reason == "stop" and record.output_tokens == 0
        assert record.decode_steps == 0 and record.first_token is None
        assert record.prefill_chunks >= -(-len(prompt) // 32)
        assert record.embedding.shape == (tiny_config.hidden_size,)
        np.testing.assert_allclose(record.embedding, reference(tiny_params, tiny_config, prompt, pooling),
                                   rtol=1e-4, atol=1e-5)


def test_an_embedding_is_computed_whole_not_from_the_prefix_cache(engine, tiny_params, tiny_config,
                                                                   tiny_tokenizer):
    """A prompt the cache holds (a generation published it) is prefilled whole for its
    embedding, whose mean needs every position's hidden state."""
    prompt = random_prompts(random.Random(2), 1, tiny_config.vocab_size, 70, 70)[0]
    sched = scheduler(engine, tiny_tokenizer)
    run_all(sched, [(prompt, GenerationParams(max_tokens=2, ignore_eos=True))])
    (s,) = run_all(sched, [(prompt, embed("mean"))])
    assert s.record.cached_tokens == 0 and s.record.prefill_chunks == 3
    np.testing.assert_allclose(s.record.embedding, reference(tiny_params, tiny_config, prompt, "mean"),
                               rtol=1e-4, atol=1e-5)


def test_a_last_token_embedding_takes_and_leaves_a_shared_prefix(engine, tiny_params, tiny_config,
                                                                  tiny_tokenizer):
    """A last-token embedding (a reranker's pairs: one query before many documents) needs no
    hidden state before its last position: it takes the prefix cache's pages, partial page
    included, and publishes its own; it still equals the reference over its whole prompt."""
    rng = random.Random(3)
    shared = random_prompts(rng, 1, tiny_config.vocab_size, 45, 45)[0]  # 2 pages of 16, and 13 more
    first, second = (shared + tail for tail in random_prompts(rng, 2, tiny_config.vocab_size, 20, 20))
    sched = scheduler(engine, tiny_tokenizer)
    (a,) = run_all(sched, [(first, embed("last"))])
    (b,) = run_all(sched, [(second, embed("last"))])
    assert a.record.cached_tokens == 0 and b.record.cached_tokens == len(shared)
    assert b.record.prefill_chunks == 1 and a.record.prefill_chunks == 3
    for s, prompt in ((a, first), (b, second)):
        np.testing.assert_allclose(s.record.embedding, reference(tiny_params, tiny_config, prompt, "last"),
                                   rtol=1e-4, atol=1e-5)
    (c,) = run_all(sched, [(second, embed("mean"))])  # (a mean needs every position: never cached)
    assert c.record.cached_tokens == 0


@pytest.mark.parametrize("length", [50, 65, 80])
def test_preempted_embeddings_start_over(shared_engine, tiny_params, tiny_config, tiny_tokenizer,
                                         length):
    """A pool that holds one longest sequence: two embeddings of priority 1 are mid-prefill when
    a generation of priority 0 arrives and preempts one of them; both embeddings (means: every
    chunk counts) still equal the reference, the chunks taken before the preemption not counted
    twice, and so does the answer."""
    engine = compiled(shared_engine(EngineConfig(**ONE_LONGEST), "needed"), "pooling")
    first, second, chat = random_prompts(random.Random(length), 3, tiny_config.vocab_size, 100, 100)
    second, chat = second[:length], chat[:64]
    subs = [(first, GenerationParams(pooling="mean", priority=1)),
            (second, GenerationParams(pooling="mean", priority=1)),
            (chat, GenerationParams(max_tokens=30, ignore_eos=True, priority=0))]
    streams = run_all(scheduler(engine, tiny_tokenizer), subs)
    assert streams[0].record.preemptions + streams[1].record.preemptions > 0
    assert streams[2].record.preemptions == 0
    assert streams[2].request.output_ids == greedy_generate(tiny_params, tiny_config, chat, 30)
    for prompt, s in zip((first, second), streams):
        np.testing.assert_allclose(s.record.embedding, reference(tiny_params, tiny_config, prompt, "mean"),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("params, param", [
    (GenerationParams(pooling="max"), "pooling"),
    (GenerationParams(pooling="mean", max_tokens=4), "max_tokens"),
    (GenerationParams(pooling="last", logprobs=2), "logprobs"),
    (GenerationParams(pooling="last", stop=("x",)), "stop"),
])
def test_embedding_parameters_are_checked(engine, tiny_tokenizer, params, param):
    with pytest.raises(SubmissionError) as e:
        scheduler(engine, tiny_tokenizer).submit([5, 6, 7], params)
    assert e.value.param == param


def test_an_input_longer_than_the_context_is_refused(engine, tiny_tokenizer):
    sched = scheduler(engine, tiny_tokenizer)
    with pytest.raises(RequestTooLong, match="exceeds the 192 tokens a sequence may hold"):
        sched.submit([5] * 193, embed("mean"))
    sched.submit([5] * 192, embed("mean")).cancel()  # the whole context is fine: nothing follows
    with pytest.raises(SubmissionError, match="one sequence"):
        sched.submit_group([5, 6], [embed("mean")] * 2, [None] * 2)


def test_a_pool_smaller_than_the_context_bounds_an_input_by_its_pages(
        shared_engine, tiny_params, tiny_config, tiny_tokenizer):
    """A pool of 11 usable pages of 16 beside its null page, under a 192-token context: a
    generation may reach 177 tokens (its last token's KV is never written), an embedding writes
    every token's KV, so 176 is its longest input: computed whole, and 177 refused."""
    engine = compiled(shared_engine(EngineConfig(**{**ONE_LONGEST, "num_pages": 12}), "needed"), "pooling")
    sched = scheduler(engine, tiny_tokenizer)
    assert sched.context == 177
    with pytest.raises(RequestTooLong, match="exceeds the 176 tokens"):
        sched.submit([5] * 177, embed("last"))
    prompt = random_prompts(random.Random(9), 1, tiny_config.vocab_size, 176, 176)[0]
    (s,) = run_all(sched, [(prompt, embed("mean"))])
    np.testing.assert_allclose(s.record.embedding, reference(tiny_params, tiny_config, prompt, "mean"),
                               rtol=1e-4, atol=1e-5)


# -- over HTTP ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def url(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer, ("tiny", "tiny-alias"), max_queue=3) as base:
        yield base


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def post(url: str, path: str = "/v1/embeddings", **body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT)


def test_v1_embeddings_of_texts_and_token_ids(url, tiny_params, tiny_config, tiny_tokenizer):
    """A batch of texts and token ids, more than the queue holds at once (max_queue=3): each
    vector is the reference's last-token hidden state at unit length, in the input's order;
    usage counts every input's tokens."""
    rng = random.Random(5)
    texts = ["Who is on the team?", "a longer text " * 12]
    ids = random_prompts(rng, 6, tiny_config.vocab_size, 2, 90)
    inputs = [texts[0], ids[0], texts[1], *ids[1:]]
    r = post(url, input=inputs, model="tiny-alias")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "tiny" and r.headers["x-request-id"] == body["id"]
    prompts = [tiny_tokenizer.encode(x) if isinstance(x, str) else x for x in inputs]
    assert body["usage"] == {"prompt_tokens": sum(map(len, prompts)), "total_tokens": sum(map(len, prompts))}
    assert [d["index"] for d in body["data"]] == list(range(len(inputs)))
    for d, prompt in zip(body["data"], prompts):
        assert d["object"] == "embedding"
        np.testing.assert_allclose(d["embedding"], unit(reference(tiny_params, tiny_config, prompt, "last")),
                                   rtol=1e-4, atol=1e-5)


def test_encodings_norms_and_truncation(url, tiny_params, tiny_config, tiny_tokenizer):
    """base64 is the float vector's little-endian float32 bytes; normalize=false is the pooled
    state as it is; truncate_prompt_tokens keeps each input's last k tokens."""
    prompt = random_prompts(random.Random(6), 1, tiny_config.vocab_size, 50, 50)[0]
    raw = reference(tiny_params, tiny_config, prompt, "last")
    floats = post(url, input=prompt).json()["data"][0]["embedding"]
    packed = post(url, input=prompt, encoding_format="base64").json()["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(packed), "<f4").tolist() == floats
    plain = post(url, input=prompt, normalize=False).json()["data"][0]["embedding"]
    np.testing.assert_allclose(plain, raw, rtol=1e-4, atol=1e-5)
    cut = post(url, input=[prompt, "some text " * 20], truncate_prompt_tokens=20).json()
    np.testing.assert_allclose(cut["data"][0]["embedding"],
                               unit(reference(tiny_params, tiny_config, prompt[-20:], "last")), rtol=1e-4, atol=1e-5)
    assert cut["usage"]["prompt_tokens"] == 40


def test_llama_server_embedding_shape_and_norms(url, tiny_params, tiny_config):
    """llama-server's /embedding (and /embeddings): [{index, embedding: [vector]}], with its
    embd_normalize: none, max-abs to int16, taxicab, euclidean, a p-norm."""
    prompt = random_prompts(random.Random(7), 1, tiny_config.vocab_size, 30, 30)[0]
    raw = reference(tiny_params, tiny_config, prompt, "last")
    norms = {-1: 1.0, 0: np.abs(raw).max() / 32760, 1: np.abs(raw).sum(), 2: np.linalg.norm(raw),
             3: np.sum(np.abs(raw) ** 3) ** (1 / 3)}
    for path in ("/embedding", "/embeddings"):
        for norm, scale in norms.items():
            r = post(url, path, content=[prompt], embd_normalize=norm)
            assert r.status_code == 200, r.text
            (entry,) = r.json()
            assert entry["index"] == 0 and len(entry["embedding"]) == 1
            np.testing.assert_allclose(entry["embedding"][0], raw / scale, rtol=1e-4, atol=1e-5 / min(1, scale))
    assert post(url, "/embedding", input="hello").status_code == 200
    both = post(url, "/embedding", input="hello", content="hello")
    assert both.status_code == 400 and both.json()["error"]["param"] == "input"
    huge = post(url, "/embedding", content=[prompt], embd_normalize=10**6).json()[0]["embedding"][0]
    np.testing.assert_allclose(huge, raw / np.abs(raw).max(), rtol=1e-4)  # the p-norm's limit: max


@pytest.mark.parametrize("body, status, param", [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": "hi", "dimensions": 7}, 400, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"input": "hi", "messages": []}, 400, "messages"),
    ({"input": [1, 10**6]}, 400, "input"),
    ({"input": [5] * 600}, 400, "input"),
    ({"input": ["hi"] * 2049}, 400, "input"),
    ({"input": "hi", "model": "other"}, 404, "model"),
])
def test_bad_embedding_requests_are_refused(url, body, status, param):
    r = post(url, **body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_the_openai_sdk_reads_its_embeddings(url, tiny_params, tiny_config, tiny_tokenizer):
    """The official SDK asks for base64 by default and decodes it."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    out = client.embeddings.create(model="tiny", input=["Who is on the team?", "Nobody."])
    assert [d.index for d in out.data] == [0, 1]
    for d, text in zip(out.data, ["Who is on the team?", "Nobody."]):
        want = unit(reference(tiny_params, tiny_config, tiny_tokenizer.encode(text), "last"))
        np.testing.assert_allclose(d.embedding, want, rtol=1e-4, atol=1e-5)


def test_mean_pooling_served(tiny_engine, tiny_params, tiny_config, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer, pooling="mean") as base:
        prompt = random_prompts(random.Random(8), 1, tiny_config.vocab_size, 70, 70)[0]
        got = post(base, input=prompt).json()["data"][0]["embedding"]
    np.testing.assert_allclose(got, unit(reference(tiny_params, tiny_config, prompt, "mean")),
                               rtol=1e-4, atol=1e-5)


# -- an embedding model's own settings ---------------------------------------------------------


def eos_tokenizer(tiny_config):
    """The tiny tokenizer as an embedding model's GGUF gives it (Qwen3-Embedding's
    tokenizer.ggml.add_eos_token), and its EOS id."""
    from cadence.checkpoints.tokenizer import Tokenizer
    from tests.conftest import tiny_tokenizer_fields

    fields = {**tiny_tokenizer_fields(tiny_config), "tokenizer.ggml.add_eos_token": True}
    return Tokenizer.from_gguf_fields(fields), fields["tokenizer.ggml.eos_token_id"]


def test_a_tokenizer_that_adds_eos_keeps_it_through_its_files(tiny_config, tmp_path):
    """add_eos_token from a GGUF, through the converted folder's tokenizer files, and from a
    Hugging Face tokenizer.json whose post-processor appends the EOS (no add_eos_token in its
    config); `with_eos` appends it once."""
    from cadence.checkpoints.tokenizer import Tokenizer

    tok, eos = eos_tokenizer(tiny_config)
    ids = tok.encode("Who is on the team?")
    assert tok.add_eos and ids[-1] != eos
    assert tok.with_eos(ids) == [*ids, eos] and tok.with_eos([*ids, eos]) == [*ids, eos]
    tok.save(tmp_path)
    assert Tokenizer.from_hf_dir(tmp_path).add_eos

    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["add_eos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert not Tokenizer.from_hf_dir(tmp_path).add_eos  # the GGUF's BPE appends nothing itself
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    token = tok.eos_token
    piece = [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": token, "type_id": 0}}]
    spec["post_processor"] = {"type": "TemplateProcessing", "single": piece, "pair": piece,
                              "special_tokens": {token: {"id": token, "ids": [eos], "tokens": [token]}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    read = Tokenizer.from_hf_dir(tmp_path)
    assert read.add_eos and read.encode("Who is on the team?") == ids  # (prompts take no EOS)


def test_an_embedding_of_a_model_that_adds_eos_ends_with_it(tiny_engine, tiny_params, tiny_config):
    """A text is embedded with the model's EOS after it, as llama.cpp tokenizes it (usage counts
    it); vLLM's add_special_tokens false leaves the BOS and the EOS out; ids are as given."""
    tok, eos = eos_tokenizer(tiny_config)
    text = "Who is on the team?"
    with serve_tiny(tiny_engine, tok) as base:
        whole = post(base, input=[text, [5, 6, 7]]).json()
        plain = post(base, input=text, add_special_tokens=False).json()
    ids = [*tok.encode(text), eos]
    assert whole["usage"]["prompt_tokens"] == len(ids) + 3
    np.testing.assert_allclose(whole["data"][0]["embedding"], unit(reference(tiny_params, tiny_config, ids, "last")),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(whole["data"][1]["embedding"],
                               unit(reference(tiny_params, tiny_config, [5, 6, 7], "last")), rtol=1e-4, atol=1e-5)
    bare = tok.encode(text, add_bos=False)
    assert plain["usage"]["prompt_tokens"] == len(bare) and bare[-1] != eos
    np.testing.assert_allclose(plain["data"][0]["embedding"], unit(reference(tiny_params, tiny_config, bare, "last")),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("declared, flag, pooled", [
    (None, None, "last"), ("mean", None, "mean"), ("last", None, "last"), ("cls", None, "last"),
    ("rank", None, "last"), ("mean", "last", "last"), (None, "mean", "mean")])
def test_the_checkpoints_pooling_is_the_default(tmp_path, tiny_config, declared, flag, pooled):
    """A GGUF's pooling_type reaches the converted model's config; the embedding doors pool by
    --pooling where given, else by the checkpoint's own where cadence pools that way, else by
    the last token."""
    import gguf
    from absl import flags
    from absl.testing import flagsaver

    from cadence.bench.random_gguf import write_random_gguf
    from cadence.checkpoints.registry import load_model
    from cadence.server.flags import pooling
    from tests.conftest import tiny_tokenizer_fields, tokenizer_keys

    def keys(w):
        tokenizer_keys(tiny_tokenizer_fields(tiny_config))(w)
        if declared is not None:
            w.add_pooling_type(gguf.PoolingType[declared.upper()])

    path = tmp_path / "embed.gguf"
    write_random_gguf(path, tiny_config, metadata=keys)
    model = load_model(str(path), tmp_path / "cache")
    assert model.config.pooling == declared
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    with flagsaver.flagsaver(pooling=flag):
        assert pooling(model.config) == pooled


def test_a_sentence_transformers_folder_names_its_pooling(tmp_path, tiny_config, tiny_params):
    """A Hugging Face folder's modules.json and its Pooling module's config give the pooling."""
    from cadence.checkpoints.hf import load_hf_config, save_hf

    save_hf(tmp_path, tiny_config, tiny_params)
    assert load_hf_config(tmp_path).pooling is None
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    for key, pooled in (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_lasttoken", "last")):
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": tiny_config.hidden_size, "pooling_mode_cls_token": False, key: True}))
        assert load_hf_config(tmp_path).pooling == pooled
