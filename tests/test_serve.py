"""`vitlab serve`: the same classes and probabilities as the model over HTTP (raw, form and JSON bodies),
requests sharing batches, one-line JSON errors for bad requests, and a server that outlives them."""

import base64
import http.client
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.cli import main
from vitlab.data.preprocess import Preprocess
from vitlab.models.registry import create_model
from vitlab.serve import (
    ImageClassifier,
    InferenceServer,
    MicroBatcher,
    RequestError,
    ServeOptions,
    make_server,
    request_images,
)
from vitlab.weights import save_native

NAMES = ["apple", "banana", "cherry", "date", "elder", "fig"]
MEAN, STD = (0.2, 0.4, 0.6), (0.3, 0.2, 0.1)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve") / "w"
    model = create_model("custom", dim=32, depth=1, heads=4, mlp_dim=64, patch_size=4, image_size=16,
                         num_classes=len(NAMES), seed=0).eval()
    with torch.no_grad():
        model.head.weight.normal_(std=2.0, generator=torch.Generator().manual_seed(0))
    save_native(model, folder, class_names=NAMES, preprocess=Preprocess(image_size=(16, 16), mean=MEAN, std=STD))
    return model, folder


def png(seed: int) -> tuple[np.ndarray, bytes]:
    arr = np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)  # the model's size: no resize
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return arr, buf.getvalue()


def reference(model, arr: np.ndarray) -> np.ndarray:
    """Probabilities with the stored preprocessing done by hand: (x / 255 - mean) / std."""
    x = (arr.astype(np.float32) / 255.0 - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
    with torch.no_grad():
        return model(torch.from_numpy(x.transpose(2, 0, 1))[None]).softmax(-1)[0].numpy()


class Running:
    """A server answering on a free port from a background thread."""

    def __init__(self, server: InferenceServer):
        self.server = server
        self.thread = threading.Thread(target=server.serve_forever, daemon=True)
        self.thread.start()
        self.host, self.port = server.server_address[:2]

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        doc = json.loads(response.read())
        conn.close()
        return response.status, doc

    def close(self):
        self.server.close()
        self.thread.join(timeout=10)


@pytest.fixture()
def served(weights):
    running = Running(make_server(weights[1], port=0, engine="torch", log=False, quiet=True,
                                  options=ServeOptions(max_batch=8, max_wait_ms=200, max_body_mb=0.01, max_images=4)))
    yield weights[0], running
    running.close()


def check_top(model, arr, top, k=5):
    ref = reference(model, arr)
    order = np.argsort(-ref)[:k]
    assert [t["label"] for t in top] == [NAMES[i] for i in order]
    assert [t["index"] for t in top] == order.tolist()
    assert [t["rank"] for t in top] == list(range(1, k + 1))
    assert np.allclose([t["probability"] for t in top], ref[order], atol=1e-5)


def test_raw_body_gives_the_models_probabilities(served):
    model, srv = served
    arr, data = png(0)
    status, doc = srv.request("POST", "/predict?top_k=3", data, {"Content-Type": "image/png"})
    assert status == 200
    [result] = doc["results"]
    check_top(model, arr, result["top"], k=3)


def test_form_files_in_order_and_json_base64(served):
    model, srv = served
    (a, pa), (b, pb) = png(1), png(2)
    boundary = "vitlab-test-boundary"
    parts = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{name}"\r\n'
        f"Content-Type: image/png\r\n\r\n".encode() + data + b"\r\n"
        for name, data in (("a.png", pa), ("b.png", pb)))
    parts += f'--{boundary}\r\nContent-Disposition: form-data; name="note"\r\n\r\nnot a file\r\n--{boundary}--\r\n'.encode()
    status, doc = srv.request("POST", "/predict", parts, {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 200, doc
    assert [r["name"] for r in doc["results"]] == ["a.png", "b.png"]  # the PNGs hold \r\n bytes: kept intact
    check_top(model, a, doc["results"][0]["top"])
    check_top(model, b, doc["results"][1]["top"])
    body = json.dumps({"images": [base64.b64encode(pb).decode(), "data:image/png;base64," + base64.b64encode(pa).decode()]})
    status, doc = srv.request("POST", "/predict", body.encode(), {"Content-Type": "application/json"})
    assert status == 200, doc
    check_top(model, b, doc["results"][0]["top"])
    check_top(model, a, doc["results"][1]["top"])
    # wrapped at 76 characters, as `base64 photo.png` and base64.encodebytes write it (was: "not valid base64")
    body = json.dumps({"images": [base64.encodebytes(pb).decode()]})
    status, doc = srv.request("POST", "/predict", body.encode(), {"Content-Type": "application/json"})
    assert status == 200, doc
    check_top(model, b, doc["results"][0]["top"])
    body = json.dumps({"images": [base64.b64encode(pb).decode() + "*"]})
    assert srv.request("POST", "/predict", body.encode(), {"Content-Type": "application/json"})[0] == 400


def test_concurrent_requests_share_batches(weights):
    """Requests queued while a batch runs share the next one. The first batch is held until all 12 requests are
    queued: in a loaded full suite on 2 cores each request could reach the server after the one before had run
    (all 12 ran alone, seen twice, once with a 2 s window); waiting for requests still being decoded is
    test_batcher_waits_only_for_images_on_their_way's."""
    model = weights[0]
    srv = Running(make_server(weights[1], port=0, engine="torch", log=False, quiet=True,
                              options=ServeOptions(max_batch=8, max_wait_ms=200, max_body_mb=0.01, max_images=4)))
    batcher = srv.server.batcher
    run, held = batcher._run, []

    def first_batch_waits(x):
        if not held:
            held.append(True)
            deadline = time.monotonic() + 60
            while batcher._waiting < 12 and time.monotonic() < deadline:
                time.sleep(0.01)
        return run(x)

    batcher._run = first_batch_waits
    try:
        _share_batches(model, srv)
    finally:
        srv.close()


def _share_batches(model, srv):
    images = [png(10 + i) for i in range(12)]
    results = [None] * len(images)
    start = threading.Barrier(len(images))

    def client(i):
        start.wait()
        results[i] = srv.request("POST", "/predict", images[i][1])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(images))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for (arr, _), (status, doc) in zip(images, results):
        assert status == 200
        check_top(model, arr, doc["results"][0]["top"])
    health = srv.request("GET", "/health")[1]
    assert health["images"] == 12
    assert health["batches"] < 12  # requests waited for each other instead of running one by one
    assert health["mean_batch"] > 1


@pytest.mark.parametrize("method, path, body, headers, status, words", [
    ("POST", "/predict", b"", {}, 400, "empty image"),
    ("POST", "/predict", b"hello", {}, 400, "not an image"),
    ("POST", "/predict", png(0)[1][:60], {}, 400, "corrupt or truncated"),
    ("POST", "/predict", b"\0" * 20000, {}, 413, "at most 0.01 MB"),
    ("POST", "/predict?top_k=0", png(0)[1], {}, 400, "top_k must be a positive integer"),
    ("POST", "/predict?top_k=abc", png(0)[1], {}, 400, "top_k must be a positive integer"),
    ("POST", "/predict", b"{not json", {"Content-Type": "application/json"}, 400, "not valid JSON"),
    ("POST", "/predict", b"[" * 10000, {"Content-Type": "application/json"}, 400, "not valid JSON (nested too deeply)"),
    ("POST", "/predict", b'{"images": ["@@@"]}', {"Content-Type": "application/json"}, 400, "not valid base64"),
    ("POST", "/predict", b'{"pictures": []}', {"Content-Type": "application/json"}, 400, '{"images"'),
    ("POST", "/predict", b'{"images": []}', {"Content-Type": "application/json"}, 400, "no image"),
    ("POST", "/predict", json.dumps({"images": [base64.b64encode(png(0)[1]).decode()] * 5}).encode(),
     {"Content-Type": "application/json"}, 413, "at most 4"),
    ("POST", "/predict", b"garbage", {"Content-Type": "multipart/form-data; boundary=x"}, 400, "multipart"),
    ("POST", "/predict", b"".join(b'--x\r\nContent-Disposition: form-data; filename="%d"\r\n\r\n.\r\n' % i
                                  for i in range(5)) + b"--x--", {"Content-Type": "multipart/form-data; boundary=x"},
     413, "5 images in one request; at most 4"),
    ("POST", "/predict", b"--x\r\n\r\n\r\n" * 21 + b"--x--", {"Content-Type": "multipart/form-data; boundary=x"},
     413, "more than 20 parts"),
    ("POST", "/predict", b'--x\r\nContent-Disposition: form-data; name="a"\r\n\r\nb\r\n--x--\r\n',
     {"Content-Type": "multipart/form-data; boundary=x"}, 400, "no file in the form"),
    ("POST", "/classify", png(0)[1], {}, 404, "POST images to /predict"),
    ("GET", "/predict", None, {}, 405, "POST an image"),
    ("GET", "/nope", None, {}, 404, "no such endpoint"),
])
def test_bad_requests_get_one_json_line(served, method, path, body, headers, status, words):
    _, srv = served
    got, doc = srv.request(method, path, body, headers)
    assert got == status
    assert words in doc["error"] and "\n" not in doc["error"]
    assert srv.request("GET", "/health")[0] == 200  # and the server answers on


def test_form_parts_are_cut_at_their_delimiters_only(served):
    model, srv = served
    arr, data = png(11)
    image = (b"preamble\r\n--b \r\nContent-Disposition: form-data; name=\"x\"; filename*=UTF-8''%C3%A9t%C3%A9.png\r\n"
             b"Content-Type: image/png\r\n\r\n" + data)
    lines = b"\r\n--b\r\nContent-Disposition: form-data; filename=\"lines.bin\"\r\n\r\n" + b"\r\n" * 3000 + b"x--b"
    form = {"Content-Type": 'multipart/form-data; boundary="b"'}
    status, doc = srv.request("POST", "/predict", image + lines + b"\r\n--b--\r\nepilogue", form)
    assert status == 400 and doc["error"].startswith("not an image") and "lines.bin" in doc["error"]
    status, doc = srv.request("POST", "/predict", image + b"\r\n--b\r\n\r\nno headers: not a file\r\n--b--", form)
    assert status == 200 and [r["name"] for r in doc["results"]] == ["\u00e9t\u00e9.png"]
    check_top(model, arr, doc["results"][0]["top"])
    for bad in (b"--b\r\nno blank line", b"--b\r\nContent-Disposition: form-data; filename=\"a\"\r\n\r\nabc",
                image + b"\r\n--b inside\r\n--b--"):
        status, doc = srv.request("POST", "/predict", bad, form)
        assert status == 400 and "malformed multipart" in doc["error"]


def test_http_servers_own_refusals_are_json_and_head_probes_work(served):
    _, srv = served
    status, doc = srv.request("BREW", "/predict")  # a method HTTP does not know
    assert status == 501 and "Unsupported method" in doc["error"]
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    for _ in range(2):  # HEAD sends the headers alone: the connection stays usable
        conn.request("HEAD", "/health")
        response = conn.getresponse()
        assert response.status == 200 and response.read() == b"" and int(response.getheader("Content-Length")) > 0
        assert response.getheader("Server").startswith("vitlab-serve")
    conn.close()


def test_refusals_that_close_the_connection(served):
    _, srv = served
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    conn.putrequest("POST", "/predict")
    conn.putheader("Transfer-Encoding", "chunked")  # no length: refused before reading
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 411 and "Content-Length" in json.loads(response.read())["error"]
    assert response.getheader("Connection") == "close"
    conn.close()


def test_keep_alive_and_decompression_bomb(served):
    model, srv = served
    bomb = io.BytesIO()
    Image.new("L", (20000, 20000)).save(bomb, format="PNG")  # 400 megapixels in a few hundred KB
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    arr, data = png(3)
    for _ in range(2):  # two requests on one connection
        conn.request("POST", "/predict", body=data)
        response = conn.getresponse()
        assert response.status == 200
        check_top(model, arr, json.loads(response.read())["results"][0]["top"])
    srv.server.options = ServeOptions(max_body_mb=5)  # room for the bomb's bytes
    conn.request("POST", "/predict", body=bomb.getvalue())
    response = conn.getresponse()
    error = json.loads(response.read())["error"]
    assert response.status == 413 and "decompression bomb" in error and "--max-pixels" in error
    conn.close()


def test_an_early_refusal_still_reads_the_body_so_the_connection_carries_on(served):
    """?top_k=0 or a wrong path is refused before the images are looked at; the body used to stay unread, and its
    bytes were parsed as the connection's next request ("PNG" 400 Bad request syntax in the log)."""
    model, srv = served
    arr, data = png(3)
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    for path, status in (("/predict?top_k=0", 400), ("/nowhere", 404), ("/predict", 200)):
        conn.request("POST", path, body=data)
        response = conn.getresponse()
        doc = json.loads(response.read())
        assert response.status == status, doc
    check_top(model, arr, doc["results"][0]["top"])  # the same connection still serves
    conn.close()


def test_health_and_info(served):
    _, srv = served
    status, info = srv.request("GET", "/info")
    assert status == 200
    assert info["classes"] == NAMES and info["image_size"] == [16, 16] and info["in_chans"] == 3
    assert info["preprocess"]["mean"] == list(MEAN)
    assert info["limits"]["max_batch"] == 8 and info["engine"].startswith("torch")
    assert " " not in info["engine"].split(" (")[0] and info["engine_note"]  # a name, and the sentence beside it
    assert srv.request("GET", "/")[1] == info
    status, health = srv.request("GET", "/health/")
    assert status == 200 and health["status"] == "ok" and health["images"] == 0  # the warm-up is not counted


def test_batcher_refuses_beyond_its_queue_and_recovers():
    release = threading.Event()

    def slow(x):
        release.wait(10)
        return x.flatten(1)[:, :3]

    batcher = MicroBatcher(slow, max_batch=1, max_wait_s=0, max_queue=2)
    first = batcher.submit([torch.zeros(1, 2, 2), torch.ones(1, 2, 2)])
    with pytest.raises(RequestError) as refused:
        batcher.submit([torch.zeros(1, 2, 2)])
    assert refused.value.status == 503 and "busy" in str(refused.value)
    release.set()
    assert [f.result(10).tolist() for f in first] == [[0, 0, 0], [1, 1, 1]]
    assert batcher.submit([torch.full((1, 2, 2), 2.0)])[0].result(10).tolist() == [2, 2, 2]
    batcher.close()


def test_a_failing_model_answers_500_and_the_server_lives_on(weights):
    model, folder = weights
    from vitlab.weights import load_with_meta

    loaded, meta = load_with_meta(folder)
    calls = []

    def flaky(x):
        calls.append(len(x))
        if len(calls) == 1:
            raise RuntimeError("boom\nsecond line")
        return loaded(x)

    srv = Running(InferenceServer(ImageClassifier(loaded, meta), flaky, {}, ServeOptions(max_wait_ms=0), port=0,
                                  log=False))
    try:
        arr, data = png(4)
        status, doc = srv.request("POST", "/predict", data)
        assert status == 500 and doc["error"] == "inference failed: boom second line"
        status, doc = srv.request("POST", "/predict", data)
        assert status == 200
        check_top(model, arr, doc["results"][0]["top"])
    finally:
        srv.close()


def test_non_finite_logits_are_an_error_not_nan_probabilities(weights):
    _, folder = weights
    from vitlab.weights import load_with_meta

    loaded, meta = load_with_meta(folder)
    srv = Running(InferenceServer(ImageClassifier(loaded, meta), lambda x: loaded(x) * float("nan"), {},
                                  ServeOptions(max_wait_ms=0), port=0, log=False))
    try:
        status, doc = srv.request("POST", "/predict", png(5)[1])
        assert status == 500 and "non-finite" in doc["error"]
    finally:
        srv.close()


def test_onnxruntime_engine_serves_the_same_probabilities(weights):
    pytest.importorskip("onnxruntime")
    model, folder = weights
    srv = Running(make_server(folder, port=0, engine="onnxruntime", log=False, quiet=True))
    try:
        assert srv.server.info["engine"].startswith("onnxruntime")
        arr, data = png(6)
        status, doc = srv.request("POST", "/predict", data)
        assert status == 200
        check_top(model, arr, doc["results"][0]["top"])
    finally:
        srv.close()


def test_bad_options_and_port_in_use(weights, capsys):
    _, folder = weights
    with pytest.raises(Exception, match="max-batch must be at least 1"):
        make_server(folder, port=0, options=ServeOptions(max_batch=0), log=False, quiet=True)
    srv = Running(make_server(folder, port=0, engine="torch", log=False, quiet=True))
    try:
        assert main(["serve", str(folder), "--port", str(srv.port), "--engine", "torch", "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert "cannot listen on" in err and "--port" in err and len(err.splitlines()) == 1
    finally:
        srv.close()
    assert main(["serve", str(folder), "--port", "70000"]) == 2
    assert "--port must be 0-65535" in capsys.readouterr().err


def test_cli_serves_until_sigterm(weights):
    _, folder = weights
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "vitlab", "serve", str(folder), "--port", "0", "--engine", "torch"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        deadline = time.time() + 120
        lines = []
        while url is None and time.time() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(r"listening on (http://\S+)", line)
            url = found.group(1) if found else None
        assert url, "".join(lines)
        parts = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        conn.request("POST", "/predict", body=png(7)[1])
        response = conn.getresponse()
        assert response.status == 200
        response.read()
        conn.request("POST", "/predict", body=b"hello")
        assert conn.getresponse().status == 400
        conn.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        rest = proc.stderr.read()
        assert re.search(r'"POST /predict HTTP/1.1" 200 1 image \d+\.\d ms', rest), rest
        assert '"POST /predict HTTP/1.1" 400 not an image (Pillow cannot identify it): image' in rest, rest
        assert "stopped after 1 image in 1 batch" in rest
    finally:
        proc.kill()


def test_connections_beyond_the_limit_get_503(weights):
    _, folder = weights
    srv = Running(make_server(folder, port=0, engine="torch", log=False, quiet=True,
                              options=ServeOptions(max_connections=1, timeout_s=20)))
    idle = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    try:
        idle.connect()  # holds the one connection thread, sending nothing
        time.sleep(0.2)
        status, doc = srv.request("GET", "/health")
        assert status == 503 and "too many connections (at most 1)" in doc["error"]
        idle.close()
        deadline = time.time() + 10
        while srv.request("GET", "/health")[0] != 200:  # the slot comes back once the idle socket is gone
            assert time.time() < deadline
            time.sleep(0.1)
    finally:
        idle.close()
        srv.close()


def test_batcher_waits_only_for_images_on_their_way():
    sizes = []

    def run(x):
        sizes.append(len(x))
        return x.flatten(1)

    batcher = MicroBatcher(run, max_batch=8, max_wait_s=5, max_queue=64)
    started = time.perf_counter()
    batcher.submit([torch.zeros(1)])[0].result(10)
    assert time.perf_counter() - started < 2  # a lone request does not sit out max_wait
    batcher.expect(2)  # two images are being decoded
    first = batcher.submit([torch.ones(1)], expected=1)[0]
    time.sleep(0.3)
    assert not first.done()  # it waits for the other one...
    second = batcher.submit([torch.ones(1)], expected=1)[0]
    assert first.result(10).tolist() == second.result(10).tolist() == [1.0]
    assert sizes == [1, 2]  # ...and they run as one batch
    batcher.close()


def test_close_lets_requests_in_flight_finish(weights):
    model, folder = weights
    from vitlab.weights import load_with_meta

    loaded, meta = load_with_meta(folder)
    entered, answered = threading.Event(), threading.Event()

    class SlowToAnswer(ImageClassifier):
        def top(self, logits, k):
            entered.set()
            time.sleep(1.0)  # the model is done; the answer is still being made
            answered.set()
            return super().top(logits, k)

    srv = Running(InferenceServer(SlowToAnswer(loaded, meta), loaded, {}, ServeOptions(max_wait_ms=0), port=0,
                                  log=False))
    arr, data = png(8)
    answer = []
    client = threading.Thread(target=lambda: answer.append(srv.request("POST", "/predict", data)))
    client.start()
    assert entered.wait(30)
    srv.close()
    assert answered.is_set()  # close() returned only after the request in flight was answered
    client.join(30)
    status, doc = answer[0]
    assert status == 200
    check_top(model, arr, doc["results"][0]["top"])


def assert_answers_like_int8(srv: Running, model, seed: int) -> None:
    """One image posted to an int8 server: answered, with the eager model's probabilities within int8's error."""
    arr, data = png(seed)
    status, doc = srv.request("POST", "/predict", data)
    assert status == 200
    top = doc["results"][0]["top"]
    ref = reference(model, arr)
    assert np.allclose([t["probability"] for t in top], ref[[t["index"] for t in top]], atol=0.05)


def test_int8_without_calibration_images_is_dynamic(weights):
    pytest.importorskip("onnxruntime")
    model, folder = weights
    srv = Running(make_server(folder, port=0, int8="auto", log=False, quiet=True))
    try:
        info = srv.server.info
        assert "no calibration images" in info["engine_note"] and info["engine"].endswith("int8-dynamic")
        assert_answers_like_int8(srv, model, 9)
    finally:
        srv.close()


def test_a_bare_model_name_is_refused(capsys):
    assert main(["serve", "vit-ti/16", "--port", "0", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a model name (random weights), not weights" in err and len(err.splitlines()) == 1


def test_fast_jpeg_decodes_large_photos_at_a_smaller_scale(weights):
    model, folder = weights
    from vitlab.weights import load_with_meta

    loaded, meta = load_with_meta(folder)
    rng = np.random.default_rng(0)
    small = Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8))
    buf = io.BytesIO()
    small.resize((640, 480), Image.BICUBIC).save(buf, format="JPEG", quality=95)
    full, fast = ImageClassifier(loaded, meta), ImageClassifier(loaded, meta, fast_jpeg=True)
    assert full.draft is None and fast.draft == (32, 32)  # twice the 16 px input
    from vitlab.data.images import decode_image

    assert decode_image(io.BytesIO(buf.getvalue()), "x", draft=fast.draft).size == (80, 60)  # 1/8: still >= 32
    a, b = full.tensor(buf.getvalue(), "x"), fast.tensor(buf.getvalue(), "x")
    assert a.shape == b.shape == (3, 16, 16)
    assert 0 < float((a - b).abs().max()) < 0.1  # another decode, nearly the same input
    png_bytes = png(0)[1]
    assert torch.equal(full.tensor(png_bytes, "p"), fast.tensor(png_bytes, "p"))  # other formats: untouched
    # --max-pixels counts a JPEG at the scale --fast-jpeg decodes it at: 640x480 is 80x60 = 4,800 pixels
    with pytest.raises(RequestError) as refused:
        full.tensor(buf.getvalue(), "x", max_pixels=10_000)
    assert refused.value.status == 413
    assert fast.tensor(buf.getvalue(), "x", max_pixels=10_000).shape == (3, 16, 16)
    srv = Running(make_server(folder, port=0, engine="torch", log=False, quiet=True,
                              options=ServeOptions(fast_jpeg=True)))
    try:
        status, doc = srv.request("POST", "/predict", buf.getvalue())
        assert status == 200 and srv.server.info["limits"]["fast_jpeg"] is True
        expected = loaded(b[None]).softmax(-1)[0]
        assert np.allclose([t["probability"] for t in doc["results"][0]["top"]],
                           expected[[t["index"] for t in doc["results"][0]["top"]]].detach().numpy(), atol=1e-5)
    finally:
        srv.close()


def test_a_model_returning_too_few_rows_fails_the_batch():
    batcher = MicroBatcher(lambda x: x.flatten(1)[:1], max_batch=2, max_wait_s=5, max_queue=8)
    batcher.expect(2)
    futures = batcher.submit([torch.zeros(1), torch.ones(1)], expected=2)
    for future in futures:
        with pytest.raises(RuntimeError, match="returned 1 rows for 2 images"):
            future.result(10)
    batcher.close()


def test_static_int8_calibrates_on_a_folder(weights, tmp_path):
    pytest.importorskip("onnxruntime")
    model, folder = weights
    for i in range(32):
        (tmp_path / f"{i}.png").write_bytes(png(100 + i)[1])
    srv = Running(make_server(folder, port=0, int8="static", calibration=str(tmp_path), log=False, quiet=True))
    try:
        assert "int8-static" in srv.server.info["engine"]
        assert_answers_like_int8(srv, model, 12)
    finally:
        srv.close()


def test_a_client_stalling_mid_body_gets_408_and_one_log_line(weights, capsys):
    """Content-Length 100 and 3 bytes, then nothing: the read timed out and was answered 500 "inference failed",
    and the next read of the dead socket logged socketserver's traceback (OSError: cannot read from timed out
    object). The timeout is ServeOptions.timeout_s (30 s by default), shortened here."""
    _, folder = weights
    srv = Running(make_server(folder, port=0, engine="torch", log=True, quiet=True,
                              options=ServeOptions(timeout_s=0.5)))
    try:
        capsys.readouterr()
        with socket.create_connection((srv.host, srv.port), timeout=30) as client:
            client.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
            answer = b""
            while chunk := client.recv(65536):  # until the server closes the connection
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head, answer
        assert "stopped arriving" in json.loads(body)["error"]
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and '"POST /predict HTTP/1.1" 408 the request body stopped arriving' in lines[0], lines
        assert srv.request("GET", "/health")[0] == 200  # and it serves on
    finally:
        srv.close()


def test_more_images_per_request_than_the_queue_holds(weights, capsys):
    """--max-queue 4 with --max-images 64: a request of 5 images was answered 503 "retry shortly" forever."""
    _, folder = weights
    with pytest.raises(Exception, match=r"--max-images \(5\) is larger than --max-queue \(4\)"):
        ServeOptions(max_images=5, max_queue=4).check()
    assert main(["serve", str(folder), "--port", "0", "--max-queue", "4", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--max-images (64) is larger than --max-queue (4)" in err and len(err.splitlines()) == 1
    batcher = MicroBatcher(lambda x: x.flatten(1), max_batch=4, max_wait_s=0, max_queue=4)
    with pytest.raises(RequestError) as refused:  # and a batcher used on its own says so too
        batcher.submit([torch.zeros(1)] * 5)
    assert refused.value.status == 413 and "at most 4 (--max-queue)" in str(refused.value)
    assert batcher.submit([torch.ones(1)] * 4)[3].result(10).tolist() == [1.0]
    batcher.close()


def test_deeply_nested_json_is_bad_json():
    with pytest.raises(RequestError) as refused:
        request_images(b"[" * 100000, "application/json")
    assert refused.value.status == 400 and "not valid JSON" in str(refused.value)


def test_images_over_max_pixels_are_refused_from_their_header(weights, monkeypatch):
    model, folder = weights
    import vitlab.data.images

    big = io.BytesIO()
    Image.new("L", (40, 30)).save(big, format="PNG")  # 1200 pixels
    srv = Running(make_server(folder, port=0, engine="torch", log=False, quiet=True,
                              options=ServeOptions(max_pixels=1000, max_wait_ms=0)))
    try:
        decode = vitlab.data.images.decode_image
        decoded = []
        monkeypatch.setattr(vitlab.data.images, "decode_image", lambda *a, **k: decoded.append(a[1]) or decode(*a, **k))
        status, doc = srv.request("POST", "/predict", big.getvalue())
        assert status == 413 and doc["error"] == ("image too large (40x30 pixels; at most 0.001 megapixels, "
                                                  "--max-pixels): image")
        assert decoded == []  # refused before any pixel was decoded
        arr, data = png(13)  # 16x16: served as before
        status, doc = srv.request("POST", "/predict", data)
        assert status == 200 and decoded == ["image"]
        check_top(model, arr, doc["results"][0]["top"])
        assert srv.server.info["limits"]["max_pixels"] == 1000
    finally:
        srv.close()
    assert ServeOptions().max_pixels == 40_000_000
    with pytest.raises(Exception, match="max-pixels must be at most"):
        ServeOptions(max_pixels=10**9).check()


def test_requests_decoding_at_once_are_bounded(weights):
    """Each decoding request holds a full-size image: 256 connections decoding at once multiplied that memory."""
    model, folder = weights
    from vitlab.weights import load_with_meta

    loaded, meta = load_with_meta(folder)
    lock, busy, peak = threading.Lock(), [0], [0]

    class Counting(ImageClassifier):
        def read(self, data, name, max_pixels=None):  # what the server decodes each image with
            with lock:
                busy[0] += 1
                peak[0] = max(peak[0], busy[0])
            time.sleep(0.3)
            with lock:
                busy[0] -= 1
            return super().read(data, name, max_pixels)

    srv = Running(InferenceServer(Counting(loaded, meta), loaded, {}, ServeOptions(max_decoding=2, max_wait_ms=0),
                                  port=0, log=False))
    try:
        images = [png(20 + i) for i in range(5)]
        answers = [None] * 5
        start = threading.Barrier(5)

        def client(i):
            start.wait()
            answers[i] = srv.request("POST", "/predict", images[i][1])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for (arr, _), (status, doc) in zip(images, answers):
            assert status == 200
            check_top(model, arr, doc["results"][0]["top"])
        assert 1 <= peak[0] <= 2
    finally:
        srv.close()
    default = InferenceServer(ImageClassifier(loaded, meta), loaded, {}, port=0, log=False)
    try:
        assert default.options.max_decoding == (os.cpu_count() or 1)  # 0: one per core
    finally:
        default.server_close()
        default.batcher.close()


def test_other_methods_get_405_with_allow_and_a_post_without_length_411(served):
    _, srv = served
    for method, path, allow in (("PUT", "/predict", "POST"), ("OPTIONS", "/predict", "POST"),
                                ("DELETE", "/health", "GET, HEAD")):
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
        conn.request(method, path, body=b"x" if method == "PUT" else None)
        response = conn.getresponse()
        doc = json.loads(response.read())
        assert response.status == 405 and response.getheader("Allow") == allow, (method, doc)
        assert method in doc["error"] and "\n" not in doc["error"]
        conn.close()
    with socket.create_connection((srv.host, srv.port), timeout=30) as client:  # curl -X POST URL: no body, no length
        client.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 411 ") and b"Content-Length" in answer.partition(b"\r\n\r\n")[2]


def test_a_port_in_use_is_refused_before_the_model_is_loaded(weights, monkeypatch):
    _, folder = weights
    import vitlab.weights

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        def load(*args, **kwargs):
            raise AssertionError("the model was loaded before the port was checked")

        monkeypatch.setattr(vitlab.weights, "load_with_meta", load)
        with pytest.raises(Exception, match=f"cannot listen on 127.0.0.1:{port}"):
            make_server(folder, port=port, engine="torch", log=False, quiet=True)


def test_request_bodies_held_at_once_are_bounded(weights):
    """Each connection read its body whole: 256 connections x 20 MB held 5 GB. Bodies being read or held count
    against --max-bodies-mb; a request that would go beyond gets 503 (retry) and its body is never read."""
    with pytest.raises(Exception, match=r"--max-bodies-mb \(1\) is smaller than --max-body-mb \(20\)"):
        ServeOptions(max_bodies_mb=1).check()
    _, folder = weights
    srv = Running(make_server(folder, port=0, engine="torch", log=False, quiet=True,
                              options=ServeOptions(max_body_mb=0.01, max_bodies_mb=0.01, timeout_s=5)))
    try:
        _, data = png(0)
        with socket.create_connection((srv.host, srv.port), timeout=30) as slow:
            # a body of 10,000 bytes announced, 10 sent: 10,000 of the 10,485 bytes are held while it arrives
            slow.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 10000\r\n\r\n0123456789")
            deadline = time.monotonic() + 10
            while srv.server._body_bytes == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            status, doc = srv.request("POST", "/predict", body=data, headers={"Content-Type": "image/png"})
            assert status == 503 and "--max-bodies-mb" in doc["error"]
        deadline = time.monotonic() + 10  # the slow client gone, its bytes are free again
        while srv.server._body_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        status, doc = srv.request("POST", "/predict", body=data, headers={"Content-Type": "image/png"})
        assert status == 200 and srv.server._body_bytes == 0
    finally:
        srv.close()


def _trickle(srv, first: bytes, every_s: float, seconds: float) -> tuple[bytes, float]:
    """Send `first`, then one byte every `every_s` s for at most `seconds`; what came back, and when it ended."""
    start = time.monotonic()
    with socket.create_connection((srv.host, srv.port), timeout=30) as client:
        client.sendall(first)
        client.settimeout(every_s)
        answer = b""
        while time.monotonic() - start < seconds:
            try:
                chunk = client.recv(65536)
            except TimeoutError:
                try:
                    client.sendall(b"x")
                except OSError:  # the server has closed it
                    break
                continue
            if not chunk:
                break
            answer += chunk
    return answer, time.monotonic() - start


def test_a_client_trickling_its_head_or_body_cannot_hold_a_thread(weights, monkeypatch):
    """One byte every 0.2 s never let a read time out (timeout_s: nothing for 30 s), so a slowloris held a
    connection thread forever and 256 of them took every one. The head now has serve_deadline.HEAD_S from its first
    byte and the body a minimum average rate (both shortened here)."""
    import vitlab.serve_deadline as deadline

    monkeypatch.setattr(deadline, "HEAD_S", 1.0)
    monkeypatch.setattr(deadline, "BODY_GRACE_S", 1.0)
    monkeypatch.setattr(deadline, "MIN_BODY_BYTES_PER_S", 1000)
    _, folder = weights
    srv = Running(make_server(folder, port=0, engine="torch", log=False, quiet=True,
                              options=ServeOptions(timeout_s=20)))
    try:
        answer, took = _trickle(srv, b"POST /predict HTTP/1.1\r\nHost: x\r\n", 0.2, 15)
        assert took < 5 and answer == b"", (took, answer)  # closed, as http.server closes a timed-out head
        answer, took = _trickle(srv, b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n", 0.2, 15)
        assert took < 5 and answer.startswith(b"HTTP/1.1 408 "), (took, answer)
        assert b"slower than 1 KB/s" in answer
        # an ordinary request on the same server, and an idle keep-alive connection, are not affected
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None
        time.sleep(1.5)  # idle between requests longer than HEAD_S: the head deadline starts at the first byte
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        srv.close()
