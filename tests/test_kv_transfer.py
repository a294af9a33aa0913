"""A KV handle moved between two processes with `jax.experimental.transfer` (engine.kv_transfer).

A peer process (tests/kv_peer.py) prefills a prompt on the tiny model and offers its KV; this
process pulls it onto its own device, inserts it into other pages of another slot of its own
engine and decodes: the tokens equal the reference generator's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from cadence.engine.engine import Engine
from cadence.engine.kv_transfer import KVReceiver, KVTicket
from cadence.engine.programs import sampling_rows
from cadence.engine.reference import greedy_generate
from cadence.model.host_sampling import RequestSampling
from tests.kv_peer import PEER_CONFIG

ROOT = Path(__file__).resolve().parent.parent


def test_a_kv_handle_moves_to_another_process_and_decoding_continues_there(tiny_params, tiny_config):
    prompt = [int(t) for t in np.random.default_rng(8).integers(3, tiny_config.vocab_size, 40)]
    want = greedy_generate(tiny_params, tiny_config, prompt, 9)
    peer = subprocess.Popen([sys.executable, "-m", "tests.kv_peer", json.dumps(prompt)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        offer = json.loads(peer.stdout.readline())
        ticket = KVTicket.from_json(offer["ticket"])
        assert ticket.length == 40 and ticket.address.startswith("127.0.0.1:")
        engine = Engine(tiny_params, tiny_config, PEER_CONFIG)
        handle = KVReceiver(address="127.0.0.1:0", transport_addresses=("127.0.0.1:0",)).pull(ticket)
        handle.block_until_ready()
        pages, slot = [2, 6, 0, 4, 8], 0  # not the peer's pages, nor its slot
        engine.insert(handle, pages, slot)
        table = np.zeros((2, PEER_CONFIG.max_pages_per_seq), np.int32)
        table[slot, : len(pages)] = pages
        rows = sampling_rows([RequestSampling()] * 2)
        got = [offer["first"]]
        for position in range(40, 48):
            positions = np.array([position, 0], np.int32)
            got.append(int(np.asarray(engine.decode(positions, np.array([True, False]), rows, table))[0, slot]))
    finally:
        peer.stdin.close()
        peer.wait(30)
    assert got == want
