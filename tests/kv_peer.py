"""The other process of tests/test_kv_transfer.py: prefills a prompt on the tiny model and
offers its KV to whoever pulls it.

    python -m tests.kv_peer PROMPT_IDS_JSON    # prints the ticket (JSON), serves until stdin closes
"""

from __future__ import annotations

import json
import sys

import numpy as np

from cadence.engine.config import EngineConfig
from cadence.engine.engine import Engine
from cadence.engine.kv_transfer import KVSender
from cadence.engine.packing import PrefillChunk
from cadence.engine.programs import sampling_rows
from cadence.model.config import TINY
from cadence.model.host_sampling import RequestSampling
from tests.conftest import random_params


# The peer's engine, and where its prompt's KV lives (the test's engine takes other pages).
PEER_CONFIG = EngineConfig(num_slots=2, max_seq_len=128, prefill_chunk=64, page_size=16, min_kv_bucket=64)
PEER_PAGES, PEER_SLOT = [5, 1, 7, 3], 1


def main() -> None:
    prompt = json.loads(sys.argv[1])
    engine = Engine(random_params(TINY), TINY, PEER_CONFIG)
    rows = sampling_rows([RequestSampling()] * PEER_CONFIG.num_slots)
    first = engine.prefill([PrefillChunk(PEER_SLOT, prompt, 0, True, PEER_PAGES)], rows)
    handle = engine.extract(PEER_PAGES, len(prompt), PEER_SLOT).block_until_ready()
    sender = KVSender(address="127.0.0.1:0", transport_addresses=("127.0.0.1:0",))
    ticket = sender.offer(handle)
    print(json.dumps({"ticket": ticket.to_json(), "first": int(np.asarray(first)[0])}), flush=True)
    sys.stdin.read()  # the arrays must outlive the pull: serve until the test is done


if __name__ == "__main__":
    main()
