"""The request path's shortcuts read what the long way would: request ids drawn from a
buffer of the OS's randomness, a UTF-8 body decoded without ``json.detect_encoding``, a
pool's replicas looked up rather than filtered."""

from __future__ import annotations

import json
import os
import re

import pytest

from backends.pool import BackendSet
from backends.replica import Replica
from gateway.errors import InvalidRequest
from gateway.middleware import new_request_id
from gateway.payload import load_json, utf8_object
from gateway.settings import BackendConfig


def test_request_ids_are_distinct_128_bit_hex_past_many_refills() -> None:
    ids = [new_request_id() for _ in range(5_000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)


def test_a_forked_child_draws_other_ids_than_its_parent() -> None:
    new_request_id()  # the parent holds buffered randomness a child would inherit
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        os.write(write_end, new_request_id().encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    child = os.read(read_end, 64).decode()
    os.close(read_end)
    assert child != new_request_id()


TEXT = '{"model": "m", "messages": [{"role": "user", "content": "héllo \\ud83d\\ude00"}]}'
BODIES = [
    TEXT.encode(),
    TEXT.encode("utf-8-sig"),
    TEXT.encode("utf-16"),
    TEXT.encode("utf-16-le"),
    TEXT.encode("utf-16-be"),
    TEXT.encode("utf-32"),
    TEXT.encode("utf-32-le"),
    b'{"a": "\\ud800"}',  # a lone surrogate, escaped: valid JSON
    '{"a": "\ud800"}'.encode("utf-8", "surrogatepass"),  # raw: json.loads takes it
    b'{"a": "\xff"}',  # no UTF-8
    b'{"a": 1} trailing',
    b"{",
    b"[1, 2]",
    b" {}",
]


@pytest.mark.parametrize("body", BODIES)
def test_a_body_reads_as_json_loads_reads_it(body: bytes) -> None:
    try:
        expected = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        with pytest.raises(InvalidRequest):
            load_json(body)
        return
    assert load_json(body) == expected


def test_the_utf8_shortcut_is_taken_only_where_json_detects_utf8() -> None:
    taken = [body for body in BODIES if utf8_object(body)]
    assert TEXT.encode() in taken  # the common body takes it
    assert all(json.detect_encoding(body) == "utf-8" for body in taken)
    assert not utf8_object(TEXT.encode("utf-16-le"))  # "{" then a 0 byte


def test_a_pool_lists_its_replicas_in_config_order() -> None:
    replicas = [
        Replica(config=BackendConfig(name=name, url=url, pool=pool), url=url)
        for name, url, pool in [
            ("a", "http://127.0.0.1:8001", "short"),
            ("b", "http://127.0.0.1:8002", "long"),
            ("c", "http://127.0.0.1:8003", "short"),
        ]
    ]
    backends = BackendSet.of(replicas)
    assert [r.name for r in backends.in_pool("short")] == ["a", "c"]
    assert [r.name for r in backends.in_pool("long")] == ["b"]
    assert backends.in_pool("batch") == ()
