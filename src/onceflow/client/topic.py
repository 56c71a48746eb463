"""Topics: a keyed producer over the streams ``NAME/0 .. NAME/n-1``.

A key always goes to the same partition: ``crc32(key) mod n`` (CRC-32 as in zlib, over the key's
UTF-8 bytes), which any language can compute, unlike Python's salted ``hash()``. Consumers and the
Spark source read the partitions in parallel; order holds per key.
"""

from __future__ import annotations

import zlib
from typing import Any

from ._errors import ConflictError
from .lowlevel import ServerURL, create_headers, http_client, parse_info, request_url, server_url, stream_url
from .producer import IdempotentProducer, ProducerStats

__all__ = ["TopicProducer", "partition_for", "partition_names"]


def partition_for(key: bytes | str, partitions: int) -> int:
    """The partition of ``key`` among ``partitions``: stable across processes, hosts and languages."""
    data = key.encode() if isinstance(key, str) else key
    return zlib.crc32(data) % partitions


def partition_names(topic: str, partitions: int) -> list[str]:
    return [f"{topic}/{i}" for i in range(partitions)]


class TopicProducer:
    """Idempotent producers for every partition of ``topic``, routed by key.

    The partitions are created if missing (with ``content_type``); an existing topic must have been
    created with the same content type. Each partition gets its own producer id,
    ``<producer_id>/<partition>``, with the same epoch rules as :class:`IdempotentProducer`.
    """

    def __init__(
        self,
        base_url: ServerURL,
        topic: str,
        *,
        partitions: int,
        content_type: str = "application/json",
        producer_id: str | None = None,
        **producer_kw: Any,
    ) -> None:
        if partitions < 1:
            raise ValueError("a topic needs at least one partition")
        self.topic = topic
        self.partitions = partitions
        base_url = server_url(base_url)
        with http_client(base_url, timeout=30.0) as client:
            for name in partition_names(topic, partitions):
                resp = client.put(
                    request_url(stream_url(base_url, name)),
                    headers=create_headers(content_type, ttl=None, expires_at=None, closed=False),
                )
                try:
                    parse_info(resp, f"create partition {name}")
                except ConflictError as exc:
                    raise ConflictError(
                        f"partition {name} exists with another configuration: {exc.message}",
                        status=exc.status,
                        code=exc.code,
                    ) from None
        self._producers = [
            IdempotentProducer(
                base_url,
                name,
                producer_id=f"{producer_id}/{i}" if producer_id else None,
                content_type=content_type,
                **producer_kw,
            )
            for i, name in enumerate(partition_names(topic, partitions))
        ]

    def send(self, key: bytes | str, value: bytes | str | Any) -> int:
        """Queue ``value`` on the key's partition; returns the partition number."""
        p = partition_for(key, self.partitions)
        self._producers[p].append(value)
        return p

    def flush(self, timeout: float | None = None) -> None:
        for prod in self._producers:
            prod.flush(timeout)

    @property
    def stats(self) -> list[ProducerStats]:
        return [p.stats for p in self._producers]

    def close(self, *, flush: bool = True) -> None:
        errors: list[BaseException] = []
        for prod in self._producers:
            try:
                prod.close(flush=flush)
            except BaseException as exc:  # noqa: BLE001 - close every partition, then raise the first
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> TopicProducer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(flush=exc_type is None)
