"""Audit of `vitlab serve` (serving area): a colour image given to a grey model is said, as `vitlab predict` says
it; request framing a proxy could read otherwise (Transfer-Encoding, loose or repeated Content-Length, a GET with a
body) is refused or ends the connection instead of letting a body be parsed as the next request."""

import io
import json
import socket
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.data.preprocess import Preprocess
from vitlab.models.registry import create_model
from vitlab.serve import ServeOptions, make_server
from vitlab.weights import save_native


@pytest.fixture(scope="module")
def grey_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grey") / "w"
    model = create_model("custom", dim=16, depth=1, heads=2, mlp_dim=32, patch_size=4, image_size=16, in_chans=1,
                         num_classes=3, seed=0).eval()
    with torch.no_grad():
        model.head.weight.normal_(std=2.0, generator=torch.Generator().manual_seed(1))
    save_native(model, folder, class_names=["a", "b", "c"],
                preprocess=Preprocess(image_size=(16, 16), mean=(0.5,), std=(0.5,), channels=1))
    server = make_server(folder, port=0, engine="torch", log=True, quiet=True,
                         options=ServeOptions(max_batch=4, max_wait_ms=0))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.close()
    thread.join(10)


def encode(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def exchange(server, data: bytes, wait: float = 2.0) -> bytes:
    """Send raw bytes on one connection and read until the server closes it or goes quiet."""
    host, port = server.server_address[:2]
    with socket.create_connection((host, port), timeout=wait) as sock:
        sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            pass
    return out


def post(server, body: bytes, content_type: str = "image/png") -> tuple[int, dict]:
    import http.client

    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("POST", "/predict", body=body, headers={"Content-Type": content_type})
    response = conn.getresponse()
    doc = json.loads(response.read())
    conn.close()
    return response.status, doc


def test_colour_images_given_to_a_grey_model_are_said_in_the_answer_and_the_log(grey_server, capfd):
    rng = np.random.default_rng(0)
    photo = encode(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8))
    grey = rng.integers(0, 256, (16, 16), dtype=np.uint8)
    grey_as_rgb = encode(np.stack([grey] * 3, axis=-1))  # an RGB file of a grey picture: nothing to say
    boundary = "b0undary"
    form = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{name}"\r\n\r\n'.encode()
                    + data + b"\r\n" for name, data in (("photo.png", photo), ("grey.png", grey_as_rgb)))
    form += f"--{boundary}--\r\n".encode()
    status, doc = post(grey_server, form, f"multipart/form-data; boundary={boundary}")
    assert status == 200, doc
    photo_result, grey_result = doc["results"]
    assert photo_result["note"] == "colour image converted to grey: the model takes grey images"
    assert "note" not in grey_result
    log = capfd.readouterr().err
    assert "200 2 images" in log and "1 colour image converted to grey" in log
    # the same probabilities as the image made grey by hand (ITU-R 601 luma, as vitlab predict)
    luma = Image.open(io.BytesIO(photo)).convert("L")
    status, by_hand = post(grey_server, encode(np.asarray(luma)))
    assert status == 200 and "note" not in by_hand["results"][0]
    assert [t["index"] for t in by_hand["results"][0]["top"]] == [t["index"] for t in photo_result["top"]]
    assert np.allclose([t["probability"] for t in by_hand["results"][0]["top"]],
                       [t["probability"] for t in photo_result["top"]], atol=1e-6)


@pytest.mark.parametrize("headers, status, words", [
    # a proxy honouring Transfer-Encoding reads another body than a server counting Content-Length (smuggling)
    (b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n", 411, "Transfer-Encoding"),
    (b"Content-Length: 4\r\nContent-Length: 40\r\n", 400, "Content-Length"),
    (b"Content-Length: +4\r\n", 400, "Content-Length"),
    (b"Content-Length: 0_4\r\n", 400, "Content-Length"),
])
def test_ambiguous_request_framing_is_refused_and_the_connection_closed(grey_server, headers, status, words):
    smuggled = b"GET /info HTTP/1.1\r\nHost: x\r\n\r\n"
    out = exchange(grey_server, b"POST /predict HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n0\r\n\r\n" + smuggled)
    assert out.startswith(f"HTTP/1.1 {status} ".encode()), out[:200]
    head, _, body = out.partition(b"\r\n\r\n")
    assert b"Connection: close" in head
    assert words in json.loads(body)["error"]
    assert out.count(b"HTTP/1.1 ") == 1  # the bytes after it were not answered as a request of their own


@pytest.mark.parametrize("method", [b"GET", b"HEAD"])
def test_a_get_with_a_body_does_not_have_its_body_answered_as_a_request(grey_server, method):
    smuggled = b"GET /info HTTP/1.1\r\nHost: x\r\n\r\n"
    out = exchange(grey_server, method + b" /health HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(smuggled)
                   + smuggled)
    assert out.startswith(b"HTTP/1.1 200 ") and b"Connection: close" in out
    assert out.count(b"HTTP/1.1 ") == 1


def test_serve_calibrates_static_int8_on_a_training_runs_images_as_predict_does(tmp_path):
    """`vitlab predict RUN --int8` calibrated on the run's own training images (static int8), `vitlab serve RUN
    --int8` found "no calibration images" and served dynamic int8, whose answers move with the batch."""
    pytest.importorskip("onnxruntime")
    from vitlab.predict import predict

    run = tmp_path / "run"
    model = create_model("custom", dim=32, depth=1, heads=4, mlp_dim=64, patch_size=4, image_size=16, num_classes=2,
                         seed=0).eval()
    save_native(model, run / "model", class_names=["x", "y"],
                preprocess=Preprocess(image_size=(16, 16), mean=(0.5,) * 3, std=(0.5,) * 3))
    rng = np.random.default_rng(0)
    for c in ("x", "y"):
        (tmp_path / "data" / c).mkdir(parents=True)
        for i in range(12):
            Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(tmp_path / "data" / c / f"{i}.png")
    (run / "config.yaml").write_text(f"data: {tmp_path / 'data'}\n")
    photo = tmp_path / "photo.png"
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(photo)
    [expected] = predict(run, [photo], int8="static", engine="onnxruntime")
    server = make_server(run, port=0, engine="onnxruntime", int8="static", log=False, quiet=True,
                         options=ServeOptions(max_batch=2, max_wait_ms=0))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert "static" in server.info["engine"]
        status, doc = post(server, photo.read_bytes())
        assert status == 200
        top = doc["results"][0]["top"]
        assert [t["index"] for t in top] == expected.indices
        assert np.allclose([t["probability"] for t in top], expected.probs, atol=1e-5)
    finally:
        server.close()
        thread.join(10)
