"""The download code against a real HTTP server on 127.0.0.1: resumed `.part` files (HTTP Range), corrupted
files caught by their hash and removed, VITLAB_OFFLINE=1 never touching the network, pretrained names and
the data-set downloads fetched through the overridable base URLs."""

import gzip
import hashlib
import http.server
import threading

import numpy as np
import pytest

import vitlab
from test_weights_hostile import official_arrays
from vitlab.data import download as data_download
from vitlab.errors import VitlabError
from vitlab.weights import hub, pretrained
from vitlab.weights.download import fetch


class Server:
    """Serves `files` (URL path -> bytes) with Range support; `cut` paths send half the body once and drop the
    connection, `corrupt` paths serve a flipped byte; every request is logged as (path, Range header)."""

    def __init__(self):
        self.files, self.cut, self.corrupt, self.log = {}, set(), set(), []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                rng = self.headers.get("Range")
                server.log.append((self.path, rng))
                body = server.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                if self.path in server.corrupt:
                    body = body[:10] + bytes([body[10] ^ 0xFF]) + body[11:]
                start = int(rng.split("=")[1].rstrip("-")) if rng else 0
                self.send_response(206 if rng else 200)
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                if self.path in server.cut and not rng:
                    server.cut.discard(self.path)
                    self.wfile.write(body[start:len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body[start:])

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VITLAB_OFFLINE", raising=False)
    s = Server()
    yield s
    s.close()


PAYLOAD = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
SHA = hashlib.sha256(PAYLOAD).hexdigest()


def test_interrupted_download_resumes_with_range(server, tmp_path):
    server.files["/w.bin"] = PAYLOAD
    server.cut.add("/w.bin")
    target = tmp_path / "w.bin"
    with pytest.raises(VitlabError, match="the next run resumes") as err:
        fetch(server.url + "/w.bin", target, sha256=SHA, progress=False, attempts=1)
    assert "\n" not in str(err.value)
    part = tmp_path / "w.bin.part"
    assert 0 < part.stat().st_size < len(PAYLOAD) and not target.exists()
    got = fetch(server.url + "/w.bin", target, sha256=SHA, progress=False)
    assert got.read_bytes() == PAYLOAD and not part.exists()
    assert server.log[-1] == ("/w.bin", f"bytes={len(PAYLOAD) // 2}-")


def test_a_cut_connection_is_resumed_within_one_call(server, tmp_path):
    server.files["/w.bin"] = PAYLOAD
    server.cut.add("/w.bin")
    got = fetch(server.url + "/w.bin", tmp_path / "w.bin", sha256=SHA, progress=False)
    assert got.read_bytes() == PAYLOAD
    assert [r for _, r in server.log] == [None, f"bytes={len(PAYLOAD) // 2}-"]


def test_corrupted_file_is_removed_and_said_so(server, tmp_path):
    server.files["/w.bin"] = PAYLOAD
    server.corrupt.add("/w.bin")
    with pytest.raises(VitlabError, match="arrived corrupted .*SHA-256.*removed") as err:
        fetch(server.url + "/w.bin", tmp_path / "w.bin", sha256=SHA, progress=False)
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(VitlabError, match="300,000 bytes instead of 5"):  # a wrong published size
        fetch(server.url + "/w.bin", tmp_path / "w.bin", size=5, progress=False)


def test_missing_file_is_one_line_with_the_http_status(server, tmp_path):
    with pytest.raises(VitlabError, match="HTTP 404") as err:
        fetch(server.url + "/nope.npz", tmp_path / "nope.npz", progress=False)
    assert len(server.log) == 1  # a 404 is not retried
    assert str(tmp_path / "nope.npz") in str(err.value)


def test_offline_mode_uses_the_cache_and_never_the_network(server, tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_OFFLINE", "1")
    server.files["/w.bin"] = PAYLOAD
    with pytest.raises(VitlabError, match="VITLAB_OFFLINE=1") as err:
        fetch(server.url + "/w.bin", tmp_path / "w.bin", progress=False)
    assert server.url + "/w.bin" in str(err.value) and str(tmp_path / "w.bin") in str(err.value)
    (tmp_path / "w.bin").write_bytes(PAYLOAD)
    assert fetch(server.url + "/w.bin", tmp_path / "w.bin", progress=False).read_bytes() == PAYLOAD
    with pytest.raises(VitlabError, match="VITLAB_OFFLINE=1"):
        vitlab.load("vit-b/16.orig-in21k")
    assert server.log == []


def _tiny_npz(path, **kw):
    np.savez(path, **official_arrays(**kw))
    return path


def test_pretrained_name_downloads_from_the_bucket_url(server, tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_WEIGHTS_URL", server.url + "/vit_models")
    server.files["/vit_models/imagenet21k/ViT-B_16.npz"] = _tiny_npz(tmp_path / "tiny.npz").read_bytes()
    server.cut.add("/vit_models/imagenet21k/ViT-B_16.npz")
    model = vitlab.load("vit-b/16.orig-in21k")
    want = vitlab.load(tmp_path / "tiny.npz")
    for (k, a), b in zip(model.state_dict().items(), want.state_dict().values()):
        assert a.equal(b), k
    cached = tmp_path / "cache" / "official" / "imagenet21k" / "ViT-B_16.npz"
    assert cached.is_file() and len(server.log) == 2  # the cut download resumed once
    vitlab.load("vit-b/16.orig-in21k")
    vitlab.load("ViT-B_16")  # the bucket's own name: the same cached file
    assert len(server.log) == 2
    # the file does not hold a B/16: create_model refuses to call it one
    with pytest.raises(VitlabError, match="does not hold a vit-b/16"):
        vitlab.create_model("vit-b/16", pretrained="orig-in21k")


def test_create_model_pretrained_like_timm(server, tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_WEIGHTS_URL", server.url)
    entry = pretrained.Pretrained("vit-mu/16.test-in1k", "vit-mu/16", "vit-bucket", "test/mu16.npz", 32,
                                  "imagenet1k")
    monkeypatch.setitem(pretrained.PRETRAINED, entry.name, entry)
    data = _tiny_npz(tmp_path / "mu.npz", dim=32, heads=2, mlp=128, patch=16, grid=2, classes=5).read_bytes()
    server.files["/test/mu16.npz"] = data
    model = vitlab.create_model("vit-mu/16", pretrained=True)
    assert model.config.num_classes == 5 and model.config.image_size == (32, 32)
    ref = vitlab.load(tmp_path / "mu.npz")
    assert model.head.weight.equal(ref.head.weight)
    tuned = vitlab.create_model("vit-mu/16", pretrained="test-in1k", num_classes=3, image_size=48)
    assert tuned.config.num_classes == 3 and float(tuned.head.weight.detach().abs().sum()) == 0.0
    assert tuned.pos_embed.shape[1] == 1 + 9
    assert tuned.blocks[0].attn.qkv.weight.equal(ref.blocks[0].attn.qkv.weight)
    with pytest.raises(VitlabError, match="not a checkpoint of 'vit-mu/16'"):
        vitlab.create_model("vit-mu/16", pretrained="augreg-in21k")
    with pytest.raises(VitlabError, match="is a checkpoint of 'vit-b/16', not 'vit-mu/16'"):
        vitlab.create_model("vit-mu/16", pretrained="vit-b/16.orig-in21k")
    with pytest.raises(VitlabError, match="no published checkpoint for 'vit-ti/8'"):
        vitlab.create_model("vit-ti/8", pretrained=True)
    assert len(server.log) == 1


def test_bit_bucket_url_is_overridable(server, monkeypatch):
    monkeypatch.setenv("VITLAB_BIT_URL", server.url + "/bit")
    server.files["/bit/BiT-M-R50x1.npz"] = b"not a zip"
    path = hub.resolve("bit-r50x1.bit-m-in21k")
    assert path.read_bytes() == b"not a zip" and path.parent.name == "bit"
    assert server.log == [("/bit/BiT-M-R50x1.npz", None)]


def test_registry_entries_are_consistent():
    from vitlab.models.registry import get_config

    names = pretrained.names()
    assert len(names) == len(set(names)) > 60
    for e in pretrained.PRETRAINED.values():
        get_config(e.model)  # every entry names a registry model
        assert e.name.startswith(e.model + ".") and e.labels in ("imagenet21k", "imagenet1k", "none")
        assert e.url.startswith(("https://storage.googleapis.com/", "https://huggingface.co/google/vit-"))
    assert pretrained.get("VIT-B/16.AUGREG_IN21K_FT_IN1K_224").image_size == 224
    with pytest.raises(VitlabError, match="did you mean vit-b/16.augreg-in21k"):
        pretrained.get("vit-b/16.augreg-in21")


def test_data_set_download_resumes_and_checks_md5(server, tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_DATA_URL", server.url + "/mirror")
    files = {name: gzip.compress(name.encode() * 5000) for name in data_download.RESOURCES["mnist"]["files"]}
    md5s = {name: hashlib.md5(body).hexdigest() for name, body in files.items()}
    monkeypatch.setitem(data_download.RESOURCES, "mnist", {"mirrors": ["http://unused/"], "files": md5s})
    for name, body in files.items():
        server.files[f"/mirror/mnist/{name}"] = body
    first = next(iter(files))
    server.cut.add(f"/mirror/mnist/{first}")
    dest = data_download.download("mnist", tmp_path / "mnist", progress=False)
    assert all((dest / n).read_bytes() == b for n, b in files.items())
    assert sum(1 for _, r in server.log if r) == 1  # the cut file resumed with a Range request
    n = len(server.log)
    data_download.download("mnist", tmp_path / "mnist", progress=False)  # all there: nothing fetched
    assert len(server.log) == n
    server.corrupt.add(f"/mirror/mnist/{first}")
    (dest / first).unlink()
    with pytest.raises(VitlabError, match="MD5") as err:
        data_download.download("mnist", tmp_path / "mnist", progress=False)
    assert "\n" not in str(err.value) and not (dest / first).exists()


def test_a_data_set_that_no_mirror_serves_gives_the_advice_once(server, tmp_path, monkeypatch):
    """Every mirror's error carried fetch()'s "without a network download it elsewhere and put it at ..." and the
    whole line added it once more: three times for MNIST's two mirrors, each naming one file of four."""
    files = data_download.RESOURCES["mnist"]["files"]
    monkeypatch.setitem(data_download.RESOURCES, "mnist", {
        "mirrors": [server.url + "/a/", server.url + "/b/"], "files": dict(files)})
    with pytest.raises(VitlabError) as err:
        data_download.download("mnist", tmp_path / "mnist", progress=False)
    line = str(err.value)
    assert line.count("without a network") == 1 and line.count("HTTP 404") == 2, line
    assert all(name in line for name in files) and line.endswith("and run the command again")


def test_unverified_bucket_file_is_still_caught_by_the_npz_crc(server, tmp_path, monkeypatch):
    """Google publishes no hashes: a corrupted .npz passes the download but fails its zip CRC-32 on reading."""
    monkeypatch.setenv("VITLAB_WEIGHTS_URL", server.url)
    good = _tiny_npz(tmp_path / "tiny.npz", dim=32, mlp=64).read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    server.files["/imagenet21k/ViT-B_32.npz"] = bytes(bad)
    with pytest.raises(VitlabError, match="Bad CRC-32") as err:
        vitlab.load("vit-b/32.orig-in21k")
    assert "\n" not in str(err.value)


def test_hub_names_go_through_huggingface_hub_and_respect_offline(monkeypatch, tmp_path):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    calls = []

    def snapshot(repo_id, **kw):
        calls.append((repo_id, kw.get("local_files_only", False)))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    monkeypatch.delenv("VITLAB_OFFLINE", raising=False)
    assert hub.resolve("vit-b/16.hf-in21k-ft-in1k-224") == tmp_path
    monkeypatch.setenv("VITLAB_OFFLINE", "1")
    assert hub.resolve("hf:google/vit-base-patch16-384") == tmp_path
    assert calls == [("google/vit-base-patch16-224", False), ("google/vit-base-patch16-384", True)]
