"""Classify images over HTTP (`vitlab serve`), running requests that arrive together as one batch.

    vitlab serve runs/demo-20261124-212148/model --int8             # http://127.0.0.1:8000
    curl --data-binary @shoe.png http://127.0.0.1:8000/predict
    curl -F image=@a.png -F image=@b.jpg 'http://127.0.0.1:8000/predict?top_k=3'

Each connection's thread decodes and preprocesses its images (as `vitlab predict` does; at most one request per
CPU core at a time) and queues them; one worker thread runs the model. The worker takes the oldest queued image
and whatever else is queued within `max_wait_ms` of it, up to `max_batch` images, as one batch: under load
requests share batches, which run at the engine's batch speed instead of its batch-1 speed
(`python benchmarks/serve.py`). It waits only while other requests are being decoded, so a lone request runs at
once. Python's standard `http.server`: serving installs
nothing more.

Endpoints: POST /predict (a raw image body, multipart/form-data files, or JSON {"images": [base64, ...]});
GET /health (status and counters); GET /info (model, classes, preprocessing, engine, limits).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import email.message
import email.parser
import email.policy
import email.utils
import io
import json
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import torch
import torch.nn as nn

from vitlab import serve_deadline
from vitlab.errors import VitlabError
from vitlab.serve_deadline import DeadlineReader


@dataclass(frozen=True)
class ServeOptions:
    """How the server batches and what it refuses."""

    max_batch: int = 32  # images per model call
    max_wait_ms: float = 5.0  # how long the oldest queued image waits for others to share its batch
    top_k: int = 5  # classes per image unless the request asks (?top_k=N)
    max_body_mb: float = 20.0  # larger request bodies: 413
    max_bodies_mb: float = 512.0  # request bodies held at once, all connections together; beyond: 503 (retry)
    max_images: int = 64  # images per request
    max_queue: int = 512  # images waiting for the model; beyond: 503 (retry later); at least max_images
    max_pixels: int = 40_000_000  # pixels per image (from its header, before decoding); beyond: 413
    max_decoding: int = 0  # requests decoding images at the same time (0: one per CPU core), bounding their memory
    max_connections: int = 256  # open connections (one thread each); beyond: 503 and closed
    timeout_s: float = 30.0  # a connection that sends nothing for this long is closed
    fast_jpeg: bool = False  # decode JPEGs at a reduced DCT scale (see ImageClassifier)

    def check(self) -> None:
        from vitlab.data.images import MAX_IMAGE_PIXELS

        for name in ("max_batch", "max_images", "max_queue", "max_connections", "max_pixels"):
            if getattr(self, name) < 1:
                raise VitlabError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_decoding < 0:
            raise VitlabError(f"max_decoding must be >= 0 (0: one per CPU core), got {self.max_decoding}")
        if self.max_images > self.max_queue:  # such a request could never be queued: a 503 "retry" that never works
            raise VitlabError(f"--max-images ({self.max_images}) is larger than --max-queue ({self.max_queue}): a "
                              "request of that many images could never be queued; lower --max-images or raise "
                              "--max-queue")
        if self.max_pixels > MAX_IMAGE_PIXELS:  # Pillow refuses larger images anyway (decompression bombs)
            raise VitlabError(f"--max-pixels must be at most {MAX_IMAGE_PIXELS} (Pillow's decompression-bomb limit), "
                              f"got {self.max_pixels}")
        if self.max_bodies_mb < self.max_body_mb:  # a request of the largest size could never be taken
            raise VitlabError(f"--max-bodies-mb ({self.max_bodies_mb:g}) is smaller than --max-body-mb "
                              f"({self.max_body_mb:g}); raise it or lower --max-body-mb")
        for name in ("max_wait_ms", "max_body_mb", "timeout_s"):
            if not getattr(self, name) >= 0:
                raise VitlabError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.top_k < 1:
            raise VitlabError(f"--top-k must be at least 1, got {self.top_k}")


class RequestError(Exception):
    """A request the server refuses: HTTP status and the one line the client gets as {"error": ...}."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


class MicroBatcher:
    """Runs `run(batch)` on one worker thread over images queued from many threads (see the module docstring)."""

    def __init__(self, run: Callable[[torch.Tensor], torch.Tensor], max_batch: int, max_wait_s: float,
                 max_queue: int):
        self._run, self.max_batch, self.max_wait_s, self.max_queue = run, max_batch, max_wait_s, max_queue
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0  # images queued or in the running batch
        self._arriving = 0  # images of requests being decoded: worth waiting for
        self.batches = self.images = 0
        self._worker = threading.Thread(target=self._loop, name="vitlab-serve-model", daemon=True)
        self._worker.start()

    def expect(self, count: int) -> None:
        """`count` images of a request are being decoded: the worker may wait for them (up to max_wait).
        `submit(..., expected=count)` or `expect(-count)` (the request failed) ends the expectation."""
        with self._lock:
            self._arriving += count

    def submit(self, images: list[torch.Tensor], expected: int = 0) -> list[Future]:
        """Queue the images of one request (all or none); each future gets that image's logits."""
        futures = [Future() for _ in images]
        now = time.monotonic()
        with self._lock:  # queued and no longer expected in one step: the worker always sees one or the other
            self._arriving -= expected
            if len(images) > self.max_queue:  # would never fit, however long the client waits: not a 503
                raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                   f"{len(images)} images in one request; at most {self.max_queue} (--max-queue)")
            if self._waiting + len(images) > self.max_queue:
                raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE,
                                   f"the server is busy ({self._waiting} images waiting); retry shortly")
            self._waiting += len(images)
            for image, future in zip(images, futures):
                self._queue.put((image, future, now))
        return futures

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=60)

    def _next_batch(self) -> list | None:
        first = self._queue.get()
        if first is None:
            return None
        batch = [first]
        deadline = first[2] + self.max_wait_s  # counted from when the oldest image was queued
        while len(batch) < self.max_batch:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._arriving:  # nothing more is coming soon: run what there is
                    break
                try:  # short polls, so that a request that fails to decode does not hold the batch back
                    item = self._queue.get(timeout=min(remaining, 0.001))
                except queue.Empty:
                    continue
            if item is None:  # closing: finish this batch, then stop
                self._queue.put(None)
                break
            batch.append(item)
        return batch

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                with torch.inference_mode():
                    logits = self._run(torch.stack([image for image, _, _ in batch])).float().cpu()
                if logits.shape[0] != len(batch):
                    raise RuntimeError(f"the model returned {logits.shape[0]} rows for {len(batch)} images")
            except Exception as exc:  # noqa: BLE001 - the requests of this batch get the error, the server lives on
                for _, future, _ in batch:
                    future.set_exception(exc)
            else:
                for row, (_, future, _) in zip(logits, batch):
                    future.set_result(row)
                self.batches += 1
                self.images += len(batch)
            finally:
                with self._lock:
                    self._waiting -= len(batch)


COLOUR_TO_GREY = "colour image converted to grey: the model takes grey images"  # a result's "note"


class ImageClassifier:
    """Image bytes -> the model's input tensor -> top-k classes: `vitlab predict`'s preprocessing and names.

    With `fast_jpeg` a JPEG is decoded at a reduced DCT scale that keeps it at least twice the model's input
    size, before the same resize: 1.7x faster at 1920x1080 and 4.3x at 12 megapixels, with inputs that differ
    from the full decode by up to 3 levels of 255 on synthetic photos and 14 on enlarged Fashion-MNIST images
    (0.2 points less accuracy there; `python benchmarks/decode.py [--accuracy 10000]`, docs/serving.md)."""

    def __init__(self, model: nn.Module, meta: dict, fast_jpeg: bool = False):
        from vitlab.predict import class_names_for, classes_of, preprocess_for

        self.preprocess = preprocess_for(model, meta)
        self.names = class_names_for(meta, classes_of(model))
        side = 2 * max(*self.preprocess.image_size, self.preprocess.effective_resize or 0)
        self.draft = (side, side) if fast_jpeg else None
        self.grey = getattr(self.preprocess, "channels", 3) == 1

    def tensor(self, data: bytes, name: str, max_pixels: int | None = None) -> torch.Tensor:
        """The model's input for one image; one of more than `max_pixels` pixels is refused (413) from its header."""
        return self.read(data, name, max_pixels)[0]

    def read(self, data: bytes, name: str, max_pixels: int | None = None) -> tuple[torch.Tensor, str | None]:
        """(the model's input for one image, a note for the client or None). The note says what the client should
        know of the conversion: a colour image given to a grey model answers about its grey version (a photo given
        to the 28 px Fashion-MNIST model), which `vitlab predict` says too; an RGB file of a grey picture is not
        colour."""
        from vitlab.data.images import decode_image
        from vitlab.predict import has_colour

        if not data:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"empty image: {name}")
        if max_pixels is not None:
            _check_pixels(data, name, max_pixels, self.draft)
        try:
            image = decode_image(io.BytesIO(data), name, max_pixels=max_pixels, draft=self.draft)
            note = COLOUR_TO_GREY if self.grey and has_colour(image) else None
            return self.preprocess(image), note
        except VitlabError as exc:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(exc)) from None

    def top(self, logits: torch.Tensor, k: int) -> list[dict]:
        if not torch.isfinite(logits).all():
            from vitlab.predict import non_finite_error

            raise RequestError(HTTPStatus.INTERNAL_SERVER_ERROR, str(non_finite_error(1, 1)))
        from vitlab.predict import top_predictions

        return top_predictions(logits[None], self.names, min(k, len(self.names)), [""])[0].top()


def _check_pixels(data: bytes, name: str, most: int, draft: tuple[int, int] | None = None) -> None:
    """413 for an image of more than `most` pixels, read from its header: a 1 KB PNG can declare 81 megapixels,
    which take seconds and hundreds of MB to decode. Image.open reads the header only. With `draft` (--fast-jpeg)
    a JPEG counts at the reduced scale it will be decoded at (`Image.draft` sets it without decoding)."""
    from PIL import Image

    from vitlab.data.images import pil_open

    try:
        with pil_open(io.BytesIO(data)) as img:  # the formats decoding accepts (no EPS and the like)
            if draft is not None and img.format == "JPEG":
                img.draft(None, draft)
            size = f"{img.width}x{img.height} pixels" if img.width * img.height > most else None
    except Image.DecompressionBombError:  # over twice Pillow's own limit: too large by any measure
        size = "a decompression bomb"
    except Exception:  # noqa: BLE001 - not an image, a broken header: decode_image says which
        size = None
    if size:
        raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                           f"image too large ({size}; at most {most / 1e6:g} megapixels, --max-pixels): {name}")


def _too_many(count: int, most: int) -> RequestError:
    return RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"{count} images in one request; at most {most}")


def _multipart_images(body: bytes, content_type: str, most: int) -> list[tuple[str, bytes]]:
    """The file parts of a multipart/form-data body (RFC 7578) as (file name, bytes). The body is cut at its
    delimiters with `bytes.split` (linear, in C); `email`'s parser, line by line in Python, took 4.7 s for a
    20 MB body of blank lines."""
    boundary = _header_param(content_type, "boundary")
    if not boundary:
        raise RequestError(HTTPStatus.BAD_REQUEST, "multipart/form-data without a boundary")
    delimiter = b"\r\n--" + boundary.encode("latin-1")
    if body.count(delimiter) > most + 16:  # before any part is parsed: a form of a million tiny parts costs nothing
        raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"a form of more than {most + 16} parts; "
                                                                f"at most {most} images")
    chunks = (b"\r\n" + body).split(delimiter)
    files = []
    for chunk in chunks[1:]:  # chunks[0]: the preamble
        if chunk.startswith(b"--"):  # the closing delimiter
            break
        padding, newline, rest = chunk.partition(b"\r\n")
        if padding.strip(b" \t") or not newline:  # the boundary inside a part's data: the client chose it badly
            raise RequestError(HTTPStatus.BAD_REQUEST, "malformed multipart/form-data body (a boundary inside a part)")
        if rest.startswith(b"\r\n"):  # a part with no headers
            head, content = b"", rest[2:]
        else:
            head, sep, content = rest.partition(b"\r\n\r\n")
            if not sep:
                raise RequestError(HTTPStatus.BAD_REQUEST,
                                   "malformed multipart/form-data body (no blank line after a part's headers)")
        headers = email.parser.BytesHeaderParser(policy=email.policy.HTTP).parsebytes(head)
        name = headers.get_filename()
        if name is not None:
            files.append((name or f"file {len(files) + 1}", content))
            if len(files) > most:
                raise _too_many(len(files), most)
    else:
        raise RequestError(HTTPStatus.BAD_REQUEST, "malformed multipart/form-data body (no closing boundary)")
    if not files:
        raise RequestError(HTTPStatus.BAD_REQUEST, "no file in the form; send images as files "
                                                   "(curl -F image=@photo.jpg URL/predict)")
    return files


def _header_param(value: str, name: str) -> str | None:
    """A parameter of a header value (`boundary` of a Content-Type), quoted or not."""
    message = email.message.Message()
    message["Content-Type"] = value
    param = message.get_param(name)
    return email.utils.collapse_rfc2231_value(param) if param else None


def _json_images(body: bytes, most: int) -> list[tuple[str, bytes]]:
    """{"images": [base64, ...]} or {"image": base64} as (name, bytes)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise RequestError(HTTPStatus.BAD_REQUEST, "the body is not valid JSON") from None
    except RecursionError:  # '[' * 100000: the parser recurses once per level
        raise RequestError(HTTPStatus.BAD_REQUEST, "the body is not valid JSON (nested too deeply)") from None
    items = doc.get("images", [doc["image"]] if "image" in doc else None) if isinstance(doc, dict) else None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise RequestError(HTTPStatus.BAD_REQUEST, 'JSON bodies look like {"images": ["<base64>", ...]}')
    if len(items) > most:
        raise _too_many(len(items), most)
    out = []
    for i, item in enumerate(items):
        try:
            # whitespace is dropped first: `base64` and `base64.encodebytes` wrap lines every 76 characters
            text = "".join(item.split(",")[-1].split())
            out.append((f"image {i + 1}", base64.b64decode(text, validate=True)))
        except (binascii.Error, ValueError):  # the split drops a data-URL prefix ("data:image/png;base64,")
            raise RequestError(HTTPStatus.BAD_REQUEST, f"image {i + 1} is not valid base64") from None
    return out


def request_images(body: bytes, content_type: str, most: int = 64) -> list[tuple[str, bytes]]:
    """The (name, bytes) images of a /predict body, by its Content-Type; more than `most`: 413."""
    kind = content_type.split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        return _multipart_images(body, content_type, most)
    if kind == "application/json":
        return _json_images(body, most)
    return [("image", body)]


class InferenceServer(ThreadingHTTPServer):
    """The HTTP server: `serve_forever()` answers requests until `close()` (both thread-safe, as in http.server)."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, classifier: ImageClassifier, run: Callable[[torch.Tensor], torch.Tensor], info: dict,
                 options: ServeOptions = ServeOptions(), host: str = "127.0.0.1", port: int = 8000,
                 log: bool = True):
        options.check()
        # each decoding request holds a full-size image (up to max_pixels x 3 bytes, and its resize): at most one per
        # core decode at once, so that 256 connections cannot multiply that memory (and they would share the cores)
        options = replace(options, max_decoding=options.max_decoding or os.cpu_count() or 1)
        self.classifier, self.options, self.log = classifier, options, log
        self._decoding = threading.BoundedSemaphore(options.max_decoding)
        # bytes of request bodies being read or held: 256 connections x 20 MB would be 5 GB of memory
        self._body_bytes, self._body_lock = 0, threading.Lock()
        self.batcher = MicroBatcher(run, options.max_batch, options.max_wait_ms / 1e3, options.max_queue)
        self.info = {**info, "classes": classifier.names, "limits": asdict(options)}
        self.started = time.time()
        self._connections = threading.BoundedSemaphore(options.max_connections)
        self._in_flight = 0  # /predict requests between their first byte read and their answer sent
        self._idle = threading.Condition()
        try:
            super().__init__((host, port), _Handler)
        except OSError as exc:
            self.batcher.close()
            raise _listen_error(host, port, exc) from None

    def process_request(self, request, client_address) -> None:
        """One thread per connection, up to max_connections: more (a flood of idle sockets) get 503 and are closed."""
        if not self._connections.acquire(blocking=False):
            body = json.dumps({"error": f"too many connections (at most {self.options.max_connections}); "
                                        "retry shortly"}).encode()
            head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
            try:
                request.sendall(head + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connections.release()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def reserve_body(self, size: int) -> None:
        """Count `size` bytes of request body against `max_bodies_mb` until `release_body`; beyond it, 503."""
        budget = int(self.options.max_bodies_mb * 2**20)
        with self._body_lock:
            if self._body_bytes + size > budget:
                raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE,
                                   f"the server holds {self._body_bytes / 2**20:.0f} MB of request bodies already "
                                   f"(--max-bodies-mb {self.options.max_bodies_mb:g}); retry shortly")
            self._body_bytes += size

    def release_body(self, size: int) -> None:
        with self._body_lock:
            self._body_bytes -= size

    def predict(self, images: list[tuple[str, bytes]], top_k: int) -> list[dict]:
        if not images:
            raise RequestError(HTTPStatus.BAD_REQUEST, "no image in the request")
        with self._decoding:  # expected only once decoding starts: the worker should not wait for requests in line
            self.batcher.expect(len(images))
            try:
                decoded = [self.classifier.read(data, name, self.options.max_pixels) for name, data in images]
            except BaseException:
                self.batcher.expect(-len(images))
                raise
            futures = self.batcher.submit([tensor for tensor, _ in decoded], expected=len(images))
        results = []
        for (name, _), (_, note), future in zip(images, decoded, futures):
            result = {"name": name, "top": self.classifier.top(future.result(), top_k)}
            if note:  # only where there is something to say: the answer of an ordinary image is unchanged
                result["note"] = note
            results.append(result)
        return results

    def health(self) -> dict:
        b = self.batcher
        return {"status": "ok", "uptime_s": round(time.time() - self.started, 1), "images": b.images,
                "batches": b.batches, "mean_batch": round(b.images / b.batches, 2) if b.batches else None}

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """Around one /predict request: `close()` lets it finish."""
        with self._idle:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def close(self, grace_s: float = 30.0) -> None:
        """Stop taking connections, let the requests in flight get their answers (up to `grace_s`), then stop
        the model's worker. Call it from another thread than `serve_forever`'s."""
        self.shutdown()
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=grace_s)
        self.server_close()
        self.batcher.close()


def _listen_error(host: str, port: int, exc: OSError) -> VitlabError:
    return VitlabError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); "
                       "choose another --port (0: any free one) or --host")


def check_port(host: str, port: int) -> None:
    """Refuse a port in use (or a bad host) in one line, before the model is loaded and its engine chosen, which
    can take a minute. A test bind, as the server binds (SO_REUSEADDR); port 0 is always free."""
    if port == 0:
        return
    with socket.socket(InferenceServer.address_family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise _listen_error(host, port, exc) from None


class _Handler(BaseHTTPRequestHandler):
    server: InferenceServer
    protocol_version = "HTTP/1.1"  # keep-alive: a client sending many requests reuses its connection
    server_version = "vitlab-serve"
    # Headers and body go out in two writes; with Nagle's algorithm the body then waits for the client's
    # delayed ACK, 40 ms per request on Linux.
    disable_nagle_algorithm = True

    def setup(self) -> None:
        self.timeout = self.server.options.timeout_s or None
        super().setup()
        # reads under deadlines (serve_deadline): a client trickling bytes cannot hold this thread
        self.reader = DeadlineReader(self.connection, self.timeout)
        self.rfile = io.BufferedReader(self.reader)

    def handle_one_request(self) -> None:
        self.reader.head()  # the head must arrive within HEAD_S of its first byte
        try:
            super().handle_one_request()
        finally:
            self.reader.clear()

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if "Transfer-Encoding" in self.headers or self.headers.get("Content-Length", "0").strip() != "0":
            # a body is not read here: its bytes would be parsed as the connection's next request (one a proxy in
            # front never saw as one), so the connection ends with this answer
            self.close_connection = True
        path = urlsplit(self.path).path.rstrip("/") or "/"
        if path == "/health":
            self._reply(HTTPStatus.OK, self.server.health())
        elif path in ("/", "/info"):
            self._reply(HTTPStatus.OK, self.server.info)
        elif path == "/predict":
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, "POST an image to /predict", allow="POST")
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no such endpoint {path}; use POST /predict, GET /health or GET /info")

    def do_HEAD(self) -> None:  # noqa: N802 - monitors and load balancers probe /health this way
        self.do_GET()

    def do_POST(self) -> None:  # noqa: N802
        with self.server.answering():
            self._predict()

    def _not_allowed(self) -> None:
        """405 with the methods the path takes (http.server's default for a known method is 501). A body is left
        unread, so the connection is closed rather than have its bytes parsed as a request."""
        self.close_connection = True
        path = urlsplit(self.path).path.rstrip("/")
        allow = "POST" if path == "/predict" else "GET, HEAD"
        self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"{self.command} is not allowed here; use {allow}", allow=allow)

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed

    def _predict(self) -> None:
        url = urlsplit(self.path)
        try:
            # the body is read before the URL is judged: a refusal that left it unread would have its bytes parsed
            # as the connection's next request (a bogus 400 logged, a keep-alive client confused)
            size = self._body_size()
            try:
                self.server.reserve_body(size)
            except RequestError:
                self.close_connection = True  # the body is not read: this connection cannot carry another request
                raise
            try:
                body = self._read_body(size)
                if url.path.rstrip("/") != "/predict":
                    raise RequestError(HTTPStatus.NOT_FOUND, f"no such endpoint {url.path}; POST images to /predict")
                top_k = self._top_k(url.query)
                started = time.perf_counter()
                images = request_images(body, self.headers.get("Content-Type", ""), self.server.options.max_images)
                results = self.server.predict(images, top_k)
            finally:
                self.server.release_body(size)
            ms = round(1e3 * (time.perf_counter() - started), 2)
            self.log_detail = f"{len(results)} image{'s' if len(results) != 1 else ''} {ms:.1f} ms"
            colour = sum(result.get("note") == COLOUR_TO_GREY for result in results)
            if colour:  # the server's operator sees it too, as `vitlab predict` says it on stderr
                self.log_detail += (f"; the model takes grey images: {colour} colour image{'s' * (colour != 1)} "
                                    "converted to grey")
            self._reply(HTTPStatus.OK, {"results": results, "ms": ms})
        except RequestError as exc:
            self._error(exc.status, str(exc))
        except Exception as exc:  # noqa: BLE001 - the model failed: the client gets one line, the server lives on
            from vitlab.cli import one_line

            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, one_line(f"inference failed: {exc}", 300))

    def _top_k(self, query: str) -> int:
        values = parse_qs(query).get("top_k")
        if not values:
            return self.server.options.top_k
        try:
            k = int(values[-1])
        except ValueError:
            k = 0
        if k < 1:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"top_k must be a positive integer, got {values[-1]!r}")
        return k

    def _body_size(self) -> int:
        """The request body's declared size; refused (and the connection closed) when it has none or is too big."""
        if "Transfer-Encoding" in self.headers:
            # chunked bodies are not read; and a Content-Length beside it (which a proxy ignores, RFC 9112 6.3) must not
            # be used either: the proxy and this server would cut the stream at different places (request smuggling)
            self.close_connection = True
            raise RequestError(HTTPStatus.LENGTH_REQUIRED, "Transfer-Encoding (chunked uploads) is not supported; "
                                                           "send the image with a Content-Length "
                                                           "(curl --data-binary @photo.jpg URL/predict)")
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            self.close_connection = True
            raise RequestError(HTTPStatus.LENGTH_REQUIRED, "send the image with a Content-Length "
                                                           "(curl --data-binary @photo.jpg URL/predict)")
        length = lengths[0].strip()
        # digits only (RFC 9112: 1*DIGIT), and one value: int() also took "+4" and "0_4", and a second,
        # different Content-Length was ignored, where a proxy in front may have used it
        if not (length.isascii() and length.isdigit()) or any(other.strip() != length for other in lengths[1:]):
            self.close_connection = True
            raise RequestError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {', '.join(lengths)!r}: one number of "
                                                       "bytes expected")
        size = int(length)
        limit = int(self.server.options.max_body_mb * 2**20)
        if size > limit:
            self.close_connection = True  # the body is not read: this connection cannot carry another request
            raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                               f"request body of {size / 2**20:.1f} MB; at most {self.server.options.max_body_mb:g} MB "
                               "(--max-body-mb)")
        return size

    def _read_body(self, size: int) -> bytes:
        """The request body, read whole, at least as fast as serve_deadline's minimum rate."""
        self.reader.body()
        try:
            body = self.rfile.read(size)
        except TimeoutError:  # the client stalled mid-body: the socket cannot be read again, so the connection ends
            self.close_connection = True
            raise RequestError(HTTPStatus.REQUEST_TIMEOUT, f"the request body stopped arriving (nothing for "
                                                           f"{self.server.options.timeout_s:g} s, or slower than "
                                                           f"{serve_deadline.MIN_BODY_BYTES_PER_S / 1000:g} KB/s)") from None
        finally:
            self.reader.clear()
        if len(body) < size:
            self.close_connection = True
            raise RequestError(HTTPStatus.BAD_REQUEST, "the request body ended early")
        return body

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a bad request line, an unsupported method, headers too long) as JSON too."""
        self.close_connection = True
        status = HTTPStatus(code)
        self._error(status, message or status.phrase)

    def _error(self, status: HTTPStatus, message: str, **headers: str) -> None:
        self.log_detail = message
        self._reply(status, {"error": message}, **headers)

    def _reply(self, status: HTTPStatus, doc: dict, **headers: str) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in headers.items():
            self.send_header(key.title(), value)
        if self.close_connection:
            self.send_header("Connection", "close")
        try:
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except OSError:  # the client went away (or stalled) before its answer: nothing to tell it, no traceback
            self.close_connection = True

    log_detail = ""  # what the access line adds after the status (images, time, or the error)

    def log_request(self, code="-", size="-") -> None:
        """One access line per answer: client, request, status and what came of it."""
        status = code.value if isinstance(code, HTTPStatus) else code
        self.log_message('"%s" %s %s', self.requestline, status, self.log_detail)
        self.log_detail = ""

    def log_error(self, format: str, *args) -> None:  # noqa: A002 - the refusal itself is in the access line
        pass

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
        if self.server.log:
            print(f"vitlab serve: {self.address_string()} {format % args}".rstrip(), file=sys.stderr, flush=True)


def make_server(weights, *, host: str = "127.0.0.1", port: int = 8000, options: ServeOptions = ServeOptions(),
                engine: str = "auto", int8: str | None = None, calibration: str | None = None,
                device: str | None = "auto",
                log: bool = True, quiet: bool = False, **load_overrides) -> InferenceServer:
    """Load `weights` (anything `vitlab.load` reads; a bare model name is refused), pick the engine as
    `vitlab predict` does (on the CPU: `engine`, `int8`; static int8 calibrates on `calibration`, a folder of
    images or any --data source), warm it up at `options.max_batch` images, and return the server, listening.
    On the CPU it keeps freed memory in glibc's heap, as every vitlab command does (`runtime.tune_cpu_allocator`),
    except what building the engine left; an ONNX Runtime or OpenVINO engine's server frees the torch weights, an
    eager torch engine's keeps only its packed copies of the large ones after the warm-up.
    Run it with `serve_forever()` (in a thread if you like); `close()` stops it."""
    from vitlab.engine import prepare_engine
    from vitlab.engine.release import release_model
    from vitlab.runtime import device_for_engine, resolve_device, tune_cpu_allocator
    from vitlab.weights import load_with_meta, resolve_model

    options.check()
    check_port(host, port)  # before the model is loaded: a port in use fails in a second, not after a minute
    model, meta = load_with_meta(weights, **load_overrides)
    classifier = ImageClassifier(model, meta, options.fast_jpeg)
    dev = resolve_device(device_for_engine(device, engine, int8))
    model = model.to(dev).eval()
    runner, name, note = model, f"torch ({dev})", f"torch ({dev}): eager PyTorch on {dev}"
    if dev.type == "cpu":
        tune_cpu_allocator()  # a server allocates the same activations on every batch: keep them (runtime.py)
        batches = None
        if int8 and calibration:
            from vitlab.engine.calibration import calibration_from_source

            batches = calibration_from_source(calibration, classifier.preprocess)
        elif int8:  # as `vitlab predict`: a training run's static int8 calibrates on its own training images (else
            # the server ran dynamic int8, whose answers move with the batch, where predict ran static)
            from vitlab.commands._engine_args import run_calibration

            batches = run_calibration(weights, classifier.preprocess)
        runner = prepare_engine(model, engine, int8=int8, calibration=batches, batch_size=options.max_batch,
                                source=resolve_model(weights), command="serve", quiet=quiet)
        name, note = runner.name, runner.note.split("engine: ", 1)[-1]
        batches = None  # static int8's calibration images: freed before the memory goes back below
        release_model(model, runner)  # the engine holds its own copy of the weights (engine/release.py)

    def run(x: torch.Tensor) -> torch.Tensor:
        return runner(x.to(dev))

    size = tuple(model.config.image_size)
    with torch.inference_mode():  # warm-up: the first request should not pay for allocations and kernel choices
        run(torch.zeros(options.max_batch, model.config.in_chans, *size))
    import vitlab

    info = {"model": str(weights), "name": model.config.name, "image_size": list(size),
            "in_chans": model.config.in_chans, "preprocess": classifier.preprocess.to_dict(),
            # the engine's name for programs (as `vitlab evaluate` records it), and the sentence saying why
            "engine": name, "engine_note": note, "device": str(dev), "threads": torch.get_num_threads(),
            "vitlab": vitlab.__version__}
    return InferenceServer(classifier, run, info, options, host, port, log)
