"""The digests of an engine start (engine/digest.py): the same for any thread count, sensitive to every byte and
to where pieces begin, and fingerprint() takes every dtype."""

import hashlib

import pytest
import torch

from vitlab.engine import digest
from vitlab.engine.choose import fingerprint


@pytest.fixture()
def small_chunks(monkeypatch):
    monkeypatch.setattr(digest, "CHUNK", 7)  # many chunks, and more than the read-ahead window


def test_same_digest_for_any_thread_count(monkeypatch, small_chunks):
    pieces = [bytes(range(256)) * 3, b"", b"name", bytes(100)]
    found = set()
    for workers in (1, 2, 4):
        monkeypatch.setattr(digest, "WORKERS", workers)
        found.add(digest.chunked_sha256(pieces))
    assert len(found) == 1


def test_every_byte_and_every_border_counts(small_chunks):
    base = digest.chunked_sha256([b"abcdefghij" * 5, b"xyz"])
    changed = bytearray(b"abcdefghij" * 5)
    changed[33] ^= 1
    assert digest.chunked_sha256([bytes(changed), b"xyz"]) != base
    assert digest.chunked_sha256([b"abcdefghij" * 5 + b"x", b"yz"]) != base  # the same bytes, another border
    assert digest.chunked_sha256([b"abcdefghij" * 5, b"xyz", b""]) != base  # an empty piece counts
    # not a plain SHA-256 of the stream (it is a digest of chunk digests), and the same as a hand-made one
    parts = [b"abcdefg", b"hijabcd"]
    by_hand = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in parts)).hexdigest()
    assert digest.chunked_sha256([b"abcdefghijabcd"]) == by_hand


def test_file_digest_reads_in_chunks(tmp_path, small_chunks):
    data = bytes(range(200)) * 2
    path = tmp_path / "graph.onnx"
    path.write_bytes(data)
    assert digest.file_sha256(path) == digest.chunked_sha256([data[i:i + 7] for i in range(0, len(data), 7)])
    path.write_bytes(data[:-1] + b"\x01")
    assert digest.file_sha256(path) != digest.chunked_sha256([data[i:i + 7] for i in range(0, len(data), 7)])


def test_fingerprint_of_every_dtype_and_every_weight():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    base = fingerprint(model)
    assert len(base) == 24 and fingerprint(model) == base
    with torch.no_grad():
        model[0].weight[2, 1] += 1e-3
    assert fingerprint(model) != base
    assert fingerprint(model.to(torch.bfloat16)) != fingerprint(model.float())  # bfloat16 has no numpy type
