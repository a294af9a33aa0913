"""Embeddings on one server: the vectors of a fixed set of texts, a corpus's throughput, and
(with --chats) the inter-token delays of closed-loop chat streams served beside the corpus.

    python bench/results/embeddings-cpu/bench.py --url=http://127.0.0.1:8123 --out=DIR [--chats]

Writes DIR/vectors.npy (the fixed texts' vectors, unit length, as served) and DIR/result.json.
The corpus is synthetic prose from a fixed word list (seeded), documents of 120-260 words, sent
as /v1/embeddings requests of --batch inputs, --clients at a time; throughput counts the
prompt tokens the server reports (usage). With --chats, --chat_streams closed-loop streamed chats
(max_tokens 64) run for the whole corpus, and once more alone, for the same number of replies;
their inter-token delays are the gaps between content chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

WORDS = ("the team meets on monday to review the plan for the quarter while the build runs and "
         "every test passes before the release goes out to users who read the notes about a new "
         "feature that makes long documents faster to search and answer questions about the code "
         "in the repository where each file holds one module with its tests beside it").split()
TEXTS = ["The team meets on Mondays.", "Who is on the team?", "def add(a, b):\n    return a + b",
         "Paris is the capital of France.", "The cat sat on the mat.",
         "Embeddings map text to vectors whose distances mean something.",
         "A long document about the quarterly plan, the build, and the release notes " * 8,
         "import numpy as np\nx = np.zeros(3)"]


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(120, 260))).capitalize() + "."
            for _ in range(n)]


async def embed(client: httpx.AsyncClient, inputs: list[str]) -> dict:
    r = await client.post("/v1/embeddings", json={"input": inputs, "model": "served"})
    r.raise_for_status()
    return r.json()


async def throughput(client: httpx.AsyncClient, docs: list[str], batch: int, clients: int) -> dict:
    batches = [docs[i:i + batch] for i in range(0, len(docs), batch)]
    queue: asyncio.Queue = asyncio.Queue()
    for b in batches:
        queue.put_nowait(b)
    tokens, latencies = 0, []

    async def worker():
        nonlocal tokens
        while not queue.empty():
            b = queue.get_nowait()
            start = time.perf_counter()
            body = await embed(client, b)
            latencies.append(time.perf_counter() - start)
            tokens += body["usage"]["prompt_tokens"]

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - start
    return {"docs": len(docs), "tokens": tokens, "seconds": round(wall, 2),
            "docs_per_s": round(len(docs) / wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "request_latency_p50_s": round(statistics.median(latencies), 3),
            "request_latency_max_s": round(max(latencies), 3)}


async def chat_stream(client: httpx.AsyncClient, rng: random.Random, gaps: list[float],
                      until) -> int:
    replies = 0
    while not until(replies):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 120)))
        body = {"model": "served", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 64, "ignore_eos": True, "stream": True, "temperature": 0}
        last = None
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not chunk["choices"] or not chunk["choices"][0]["delta"].get("content"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
        replies += 1
    return replies


def summary(gaps: list[float]) -> dict:
    a = np.asarray(gaps)
    return {"gaps": len(a), "p50_s": round(float(np.percentile(a, 50)), 4),
            "p99_s": round(float(np.percentile(a, 99)), 4), "max_s": round(float(a.max()), 4)}


async def main(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=args.url, timeout=600, limits=limits) as client:
        body = await embed(client, TEXTS)
        vectors = np.asarray([d["embedding"] for d in body["data"]], np.float32)
        np.save(out / "vectors.npy", vectors)
        result = {"url": args.url, "fixed_texts": len(TEXTS), "fixed_tokens": body["usage"]["prompt_tokens"],
                  "dimensions": int(vectors.shape[1])}
        await throughput(client, corpus(16, seed=99), args.batch, args.clients)  # warm
        docs = corpus(args.docs)
        result["alone"] = await throughput(client, docs, args.batch, args.clients)
        if args.chats:
            rng = random.Random(1)
            gaps: list[float] = []
            done = asyncio.Event()
            chats = [asyncio.create_task(chat_stream(client, rng, gaps, lambda _: done.is_set()))
                     for _ in range(args.chat_streams)]
            await asyncio.sleep(3)  # the chats under way
            gaps.clear()
            result["beside_chats"] = await throughput(client, docs, args.batch, args.clients)
            done.set()
            replies = sum(await asyncio.gather(*chats))
            result["chats_beside_embeddings"] = {**summary(gaps), "replies": replies}
            alone: list[float] = []
            per = max(1, replies // args.chat_streams)
            await asyncio.gather(*(chat_stream(client, rng, alone, lambda n: n >= per)
                                   for _ in range(args.chat_streams)))
            result["chats_alone"] = {**summary(alone), "replies": per * args.chat_streams}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--docs", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--chats", action="store_true")
    p.add_argument("--chat_streams", type=int, default=4)
    asyncio.run(main(p.parse_args()))
