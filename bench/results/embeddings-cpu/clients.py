"""Real clients against a running cadence-serve's /v1/embeddings: LangChain's OpenAIEmbeddings
(1000 documents in one call, its default chunk size), LiteLLM's embedding(), and the openai SDK;
each one's vectors against the server's own answer to a plain float request.

    python bench/results/embeddings-cpu/clients.py http://127.0.0.1:8124   (in a venv with
    langchain-openai and litellm)
"""

import random
import sys
import time

import httpx
import litellm
import numpy as np
import openai
from langchain_openai import OpenAIEmbeddings

url = sys.argv[1]
rng = random.Random(0)
words = "the team meets on monday to plan the build and the release of a new feature".split()
docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(1000)]


def direct(texts):
    r = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=600)
    r.raise_for_status()
    return np.asarray([d["embedding"] for d in r.json()["data"]])


def agree(name, got, texts):
    want = direct(texts)
    got = np.asarray(got)
    print(f"{name}: {len(got)} vectors of {got.shape[1]}, largest difference from the server's "
          f"float answer {np.abs(got - want).max():.2e}")


# LangChain tokenizes with tiktoken unless told not to: those ids are not this model's.
lc = OpenAIEmbeddings(model="served", base_url=f"{url}/v1", api_key="unused",
                      check_embedding_ctx_length=False)
start = time.perf_counter()
vectors = lc.embed_documents(docs)
print(f"LangChain embed_documents: {len(docs)} documents in one request, {time.perf_counter() - start:.1f} s")
agree("LangChain embed_documents (first 64)", vectors[:64], docs[:64])
agree("LangChain embed_query", [lc.embed_query("Who is on the team?")], ["Who is on the team?"])

out = litellm.embedding(model="openai/served", input=docs[:8], api_base=f"{url}/v1", api_key="unused")
agree("LiteLLM embedding", [d["embedding"] for d in out.data], docs[:8])

client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
out = client.embeddings.create(model="served", input=docs[:8])  # base64, decoded by the SDK
agree("openai SDK (base64)", [d.embedding for d in out.data], docs[:8])
