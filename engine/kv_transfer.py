"""Moving a KV handle to another process, on this host or another, with `jax.experimental.transfer`.

    # the process that prefilled
    sender = KVSender()                                   # a transfer server of this process
    ticket = sender.offer(engine.extract(pages, length, slot))
    send(ticket.to_json())                                # over any control channel
    # the process that decodes
    receiver = KVReceiver(device)
    handle = receiver.pull(KVTicket.from_json(message))   # a KVHandle on `device`
    engine.insert(handle, free_pages, slot)               # decoding continues there

Disaggregated serving within one process moves handles with `jax.device_put` (`KVHandle.to`).
Past one process, JAX's transfer servers move arrays between the processes' runtimes directly:
the sender registers a handle's arrays under an id, and the receiver pulls them by id onto its
own device. A ticket names the id, the sender's address, and the arrays' shapes and dtype, which
the receiver needs to allocate them. An offered handle stays alive on the sender until it is
pulled. Tested between two processes on one machine (tests/test_kv_transfer.py); cadence's
scheduler runs both pools in one process, so no serving mode uses this yet.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
from jax.experimental import transfer

from cadence.engine.results import KVHandle


@dataclasses.dataclass(frozen=True)
class KVTicket:
    """What a receiver needs to pull one offered handle."""

    address: str  # the sender's transfer server
    uuid: int
    shape: tuple[int, ...]  # of k and v: [layers, kv_heads, P, page_size, head_dim]
    dtype: str
    length: int
    page_size: int

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> KVTicket:
        fields = json.loads(text)
        return cls(**{**fields, "shape": tuple(fields["shape"])})


def _server(device: jax.Device, address: str, transport_addresses: tuple[str, ...]):
    return transfer.start_transfer_server(device.client, address, list(transport_addresses))


class KVSender:
    """Offers handles to other processes. `address` is where receivers connect (host:port; port
    0 picks a free one); `transport_addresses` where the bulk copies flow."""

    def __init__(self, device: jax.Device | None = None, address: str = "[::]:0",
                 transport_addresses: tuple[str, ...] = ()):
        self._server = _server(device or jax.devices()[0], address, transport_addresses)
        self._ids = itertools.count(1)

    @property
    def address(self) -> str:
        return self._server.address()

    def offer(self, handle: KVHandle) -> KVTicket:
        """Registers the handle's arrays for one pull; returns at once."""
        uuid = next(self._ids)
        self._server.await_pull(uuid, [handle.k, handle.v, handle.next_token])
        return KVTicket(self.address, uuid, tuple(handle.k.shape), str(handle.k.dtype), handle.length,
                        handle.page_size)


class KVReceiver:
    """Pulls offered handles onto `device`."""

    def __init__(self, device: jax.Device | None = None, address: str = "[::]:0",
                 transport_addresses: tuple[str, ...] = ()):
        self.device = device or jax.devices()[0]
        self._server = _server(self.device, address, transport_addresses)
        self._connections: dict[str, object] = {}

    def pull(self, ticket: KVTicket) -> KVHandle:
        """The ticket's handle, on this receiver's device (the arrays arrive asynchronously;
        `block_until_ready` waits for them)."""
        connection = self._connections.get(ticket.address)
        if connection is None:
            connection = self._connections[ticket.address] = self._server.connect(ticket.address)
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        pages = jax.ShapeDtypeStruct(ticket.shape, jnp.dtype(ticket.dtype), sharding=sharding)
        token = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding)
        k, v, next_token = connection.pull(ticket.uuid, [pages, pages, token])
        return KVHandle(k=k, v=v, next_token=next_token, length=ticket.length, page_size=ticket.page_size)
