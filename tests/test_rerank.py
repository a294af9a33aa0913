"""Reranking (checkpoints/ranking.py, server/rerank_api.py): a reranker's head read from a GGUF
as llama.cpp's converter writes it and kept through a conversion; each (query, document) pair's
score over loopback HTTP equal to the reference model's last hidden state through the head;
the shapes clients send (Jina/Cohere/vLLM's rerank, TEI's, vLLM's score), ordered and cut as
asked; and the 400s, a model without a head's among them."""

from __future__ import annotations

import dataclasses

import gguf
import httpx
import numpy as np
import pytest

from cadence.bench.random_gguf import write_random_gguf
from cadence.checkpoints import registry
from cadence.checkpoints.gguf import load_ranking
from cadence.checkpoints.ranking import RankingHead
from cadence.engine.reference import sequence_logits
from cadence.model.config import TINY
from tests.conftest import loopback_server, serve_tiny, tiny_app, tiny_tokenizer_fields, tokenizer_keys

TIMEOUT = httpx.Timeout(120.0, connect=5.0)
# Qwen3-Reranker's template as llama.cpp's converter writes it, shortened for the tiny context.
TEMPLATE = ("<|im_start|>system\nJudge yes or no.<|im_end|>\n<|im_start|>user\n<Query>: {query}\n"
            "<Document>: {document}<|im_end|>\n<|im_start|>assistant\n")
DOCUMENTS = ["the cat sat", "a dog ran far away", "", "cats and dogs"]


@pytest.fixture(scope="module")
def head(tiny_params):
    """A Qwen3-Reranker-like head: two rows of the tiny model's LM head (its tied embedding)."""
    rows = np.asarray(tiny_params["embed"]["embedding"], np.float32)[[5, 9]]
    return RankingHead(rows, None, softmax=True, template=TEMPLATE, labels=("yes", "no"))


@pytest.fixture(scope="module")
def url(tiny_engine, tiny_tokenizer, head):
    with serve_tiny(tiny_engine, tiny_tokenizer, "tiny", ranking=head) as base:
        yield base


def expected(params, tokenizer, head: RankingHead, query: str, document: str) -> tuple[float, int]:
    """The pair's score from the reference's forward pass over its whole prompt, and its tokens."""
    ids = head.prompt(tokenizer, query, document)
    hidden = sequence_logits(params, TINY, ids, hidden=True)[-1]
    logits = head.weight.astype(np.float64) @ hidden.astype(np.float64)
    return float(np.exp(logits[0]) / np.exp(logits).sum()), len(ids)


def test_scores_are_the_references_best_first(url, tiny_params, tiny_tokenizer, head):
    want = [expected(tiny_params, tiny_tokenizer, head, "cats", d) for d in DOCUMENTS]
    answer = httpx.post(f"{url}/v1/rerank", json={"model": "tiny", "query": "cats", "documents": DOCUMENTS},
                        timeout=TIMEOUT).json()
    results = answer["results"]
    assert [r["index"] for r in results] == sorted(range(4), key=lambda i: -want[i][0])
    for r in results:
        assert r["relevance_score"] == pytest.approx(want[r["index"]][0], abs=2e-5)
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    assert answer["usage"]["prompt_tokens"] == sum(n for _, n in want) and answer["model"] == "tiny"
    assert answer["object"] == "list" and answer["id"]

    # {"text"} documents, top_n, no documents back, llama-server's and Cohere's paths
    for path in ("/rerank", "/reranking", "/v1/reranking", "/v2/rerank"):
        top = httpx.post(f"{url}{path}", json={"query": "cats", "top_n": 2, "return_documents": False,
                                               "documents": [{"text": d} for d in DOCUMENTS]}, timeout=TIMEOUT).json()
        assert [(r["index"], r["relevance_score"]) for r in top["results"]] == \
            [(r["index"], r["relevance_score"]) for r in results[:2]]
        assert all("document" not in r for r in top["results"])

    # TEI's shape: `texts`, a bare list, `score`, the text only when asked
    tei = httpx.post(f"{url}/rerank", json={"query": "cats", "texts": DOCUMENTS, "return_text": True},
                     timeout=TIMEOUT).json()
    assert [(r["index"], r["score"], r["text"]) for r in tei] == \
        [(r["index"], r["relevance_score"], DOCUMENTS[r["index"]]) for r in results]


def test_vllms_score_pairs_one_query_with_many_or_one_to_one(url, tiny_params, tiny_tokenizer, head):
    many = httpx.post(f"{url}/v1/score", json={"text_1": "cats", "text_2": DOCUMENTS[:2]}, timeout=TIMEOUT).json()
    assert [d["index"] for d in many["data"]] == [0, 1] and many["object"] == "list"
    for d, doc in zip(many["data"], DOCUMENTS):
        assert d["object"] == "score"
        assert d["score"] == pytest.approx(expected(tiny_params, tiny_tokenizer, head, "cats", doc)[0], abs=2e-5)
    pairs = httpx.post(f"{url}/score", json={"text_1": ["dogs", "cats"], "text_2": DOCUMENTS[:2]},
                       timeout=TIMEOUT).json()
    want = [expected(tiny_params, tiny_tokenizer, head, q, d)[0] for q, d in (("dogs", DOCUMENTS[0]), ("cats", DOCUMENTS[1]))]
    assert [d["score"] for d in pairs["data"]] == pytest.approx(want, abs=2e-5)
    assert pairs["data"][1]["score"] == pytest.approx(many["data"][1]["score"], abs=1e-6)


def test_one_querys_pairs_after_the_first_take_its_prefix_from_the_cache(tiny_engine, tiny_tokenizer, head):
    """The first pair is prefilled alone; every other pair of the query is admitted after its
    pages are cached and takes the prefix it shares with it (the template's start and the query)."""
    app, sched = tiny_app(tiny_engine, tiny_tokenizer, "tiny", ranking=head)
    records = []
    sched.listeners.append(records.append)
    documents = [f"document number {i} says something" for i in range(6)]
    with loopback_server(app) as base:
        answer = httpx.post(f"{base}/v1/rerank", json={"query": "a query of its own", "documents": documents},
                            timeout=TIMEOUT)
    assert answer.status_code == 200
    prompts = [head.prompt(tiny_tokenizer, "a query of its own", d) for d in documents]
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)
    cached = {r.request_id: r.cached_tokens for r in records}
    assert len(cached) == 6 and sorted(cached.values())[1:] == [shared] * 5


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rerank", {"documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": [3]}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": [{"text": "a", "title": "b"}]}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "texts": ["a"]}, "texts"),
    ("/rerank", {"query": "q", "texts": [{"text": "a"}]}, "texts"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "rank_fields": ["x"]}, "rank_fields"),
    ("/v1/rerank", {"query": "q", "documents": ["a" * 3000]}, "documents"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
])
def test_bad_requests_are_400s_naming_the_field(url, path, body, param):
    response = httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_a_model_without_a_ranking_head_says_so(tiny_engine, tiny_tokenizer):
    with serve_tiny(tiny_engine, tiny_tokenizer, "tiny") as base:
        for path in ("/v1/rerank", "/v1/score"):
            response = httpx.post(f"{base}{path}", json={"query": "q", "documents": ["a"]}, timeout=TIMEOUT)
            assert response.status_code == 400 and "no ranking head" in response.json()["error"]["message"]


def _reranker_keys(weight: np.ndarray, qtype=gguf.GGMLQuantizationType.F32, template=TEMPLATE):
    def add(w: gguf.GGUFWriter) -> None:
        tokenizer_keys(tiny_tokenizer_fields(TINY))(w)
        w.add_pooling_type(gguf.PoolingType.RANK)
        w.add_classifier_output_labels(["yes", "no"])
        if template is not None:
            w.add_chat_template([{"name": "rerank", "template": template}])
        data = weight if qtype == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(weight, qtype)
        w.add_tensor("cls.output.weight", data, raw_dtype=None if qtype == gguf.GGMLQuantizationType.F32 else qtype)
    return add


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0])
def test_a_gguf_rerankers_head_is_read_and_kept_through_a_conversion(tmp_path, monkeypatch, qtype):
    """llama.cpp's layout (a qwen3 file: pooling type rank, `cls.output` rows yes and no, the
    "rerank" template) reads as the head, its rows dequantized as the file stores them; a
    conversion keeps it beside the model. A file without cls.output has none."""
    weight = np.random.default_rng(0).normal(size=(2, TINY.hidden_size)).astype(np.float32)
    config = dataclasses.replace(TINY, qk_norm=True)
    path = tmp_path / "reranker.gguf"
    write_random_gguf(path, config, "qwen3", metadata=_reranker_keys(weight, qtype))
    head = load_ranking(path)
    stored = gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype) if qtype != gguf.GGMLQuantizationType.F32 else weight
    np.testing.assert_array_equal(head.weight, stored)
    assert head.softmax and head.template == TEMPLATE and head.labels == ("yes", "no") and head.bias is None

    monkeypatch.setenv("CADENCE_CACHE", str(tmp_path / "cache"))
    model = registry.load_model(str(path))
    assert model.config.pooling == "rank"
    np.testing.assert_array_equal(model.ranking.weight, head.weight)
    assert (model.ranking.template, model.ranking.softmax, model.ranking.labels) == (TEMPLATE, True, ("yes", "no"))

    plain = tmp_path / "plain.gguf"
    write_random_gguf(plain, config, "qwen3", metadata=tokenizer_keys(tiny_tokenizer_fields(TINY)))
    assert load_ranking(plain) is None and registry.load_model(str(plain)).ranking is None


def test_the_pairs_layout_without_a_template_and_the_heads_score(tmp_path, tiny_tokenizer):
    """No template: llama.cpp's layout (BOS where the tokenizer adds one, the query, EOS where
    it adds one, the document, EOS); the score is the first output's probability (a softmax
    head, Qwen3's) or the output as it is."""
    head = RankingHead(np.array([[1.0, 0.0], [0.0, 1.0]], np.float32), np.array([0.5, -0.5], np.float32),
                       softmax=False)
    templated = dataclasses.replace(head, template=TEMPLATE).prompt(tiny_tokenizer, "cats", "a dog")
    assert templated == tiny_tokenizer.encode(TEMPLATE.replace("{query}", "cats").replace("{document}", "a dog"),
                                              add_bos=False)
    assert templated[0] == tiny_tokenizer.encode("<|im_start|>", add_bos=False)[0]  # (a special token, one id)
    ids = head.prompt(tiny_tokenizer, "cats", "a dog")
    assert ids == (tiny_tokenizer.with_eos(tiny_tokenizer.encode("cats", special=False))
                   + tiny_tokenizer.with_eos(tiny_tokenizer.encode("a dog", add_bos=False, special=False)))
    assert head.score(np.array([2.0, 1.0])) == pytest.approx(2.5)
    soft = dataclasses.replace(head, softmax=True)
    assert soft.score(np.array([2.0, 1.0])) == pytest.approx(1 / (1 + np.exp(-(2.5 - 0.5))))
    (tmp_path / "ranking.npz").write_bytes(head.file_bytes())  # as a converted checkpoint keeps it
    kept = RankingHead.load(tmp_path)
    np.testing.assert_array_equal(kept.weight, head.weight)
    np.testing.assert_array_equal(kept.bias, head.bias)
    assert (kept.softmax, kept.template, kept.labels) == (False, None, ())
