"""`vitlab serve WEIGHTS`: an HTTP server that classifies images, batching requests that arrive together."""

from __future__ import annotations

import argparse

from vitlab.commands._argtypes import THREADS_HELP, non_negative_float, positive_float, positive_int
from vitlab.commands._engine_args import add_engine_arguments
from vitlab.commands._load_args import WEIGHTS_HELP, add_load_arguments


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="classify images over HTTP (POST /predict), batching concurrent requests",
        description="Serve a model over HTTP: POST /predict takes an image as the body (curl --data-binary "
                    "@photo.jpg URL/predict), as form files (curl -F image=@a.jpg -F image=@b.png URL/predict) or "
                    'as JSON {"images": [base64, ...]}, and answers the top-k classes as JSON (?top_k=N). '
                    "GET /health and GET /info say how it runs. Requests that arrive within --max-wait-ms of "
                    "each other run as one batch of up to --max-batch images. Ctrl-C or SIGTERM stops it.",
    )
    p.add_argument("weights", help=WEIGHTS_HELP)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed)")
    p.add_argument("--max-batch", type=positive_int, default=32, help="images per model call (default 32)")
    p.add_argument("--max-wait-ms", type=non_negative_float, default=5.0,
                   help="how long a request waits for others to share its batch (default 5)")
    p.add_argument("--top-k", type=positive_int, default=5, help="classes per image unless ?top_k=N (default 5)")
    p.add_argument("--max-body-mb", type=positive_float, default=20.0, help="largest request body (default 20 MB)")
    p.add_argument("--max-bodies-mb", type=positive_float, default=512.0,
                   help="request bodies held at once, all connections together; beyond, 503 (default 512 MB)")
    p.add_argument("--max-images", type=positive_int, default=64,
                   help="images per request (default 64; at most --max-queue)")
    p.add_argument("--max-queue", type=positive_int, default=512,
                   help="images waiting for the model before requests are refused with 503 (default 512)")
    p.add_argument("--max-pixels", type=positive_int, default=40_000_000,
                   help="pixels per image, read from its header before decoding; larger images get 413 "
                        "(default 40000000: 40 megapixels)")
    p.add_argument("--fast-jpeg", action="store_true",
                   help="decode JPEGs at a reduced scale (at least twice the model's input size) before resizing: "
                        "1.7x faster at 1080p, 4.3x at 12 MP; inputs a little off a full decode (enlarged "
                        "Fashion-MNIST JPEGs: -0.2 points, 99.2%% of answers the same; docs/serving.md)")
    p.add_argument("--image-size", type=positive_int, help="model input size (resamples ViT position embeddings)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ... (default auto: cuda when available)")
    p.add_argument("--threads", type=positive_int, help=THREADS_HELP)
    add_load_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no request log or notes on stderr")
    add_engine_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import signal
    import sys
    import threading

    from vitlab.commands._load_args import load_overrides
    from vitlab.errors import VitlabError
    from vitlab.runtime import device_for_engine, setup_runtime
    from vitlab.serve import ServeOptions, make_server

    if not 0 <= args.port <= 65535:
        raise VitlabError(f"--port must be 0-65535, got {args.port}")
    options = ServeOptions(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, top_k=args.top_k,
                           max_body_mb=args.max_body_mb, max_bodies_mb=args.max_bodies_mb,
                           max_images=args.max_images, max_queue=args.max_queue,
                           max_pixels=args.max_pixels, fast_jpeg=args.fast_jpeg)
    options.check()  # a bad combination of flags fails before anything is set up
    runtime = setup_runtime(device_for_engine(args.device, args.engine, args.int8), args.threads)
    runtime.announce("serve", args.quiet)
    overrides, image_size = load_overrides(args)
    server = make_server(args.weights, host=args.host, port=args.port, options=options, engine=args.engine,
                         int8=args.int8, calibration=args.calibration, device=str(runtime.device), log=not args.quiet,
                         quiet=args.quiet, image_size=image_size, **overrides)
    # SIGTERM (docker stop, systemd) stops it like Ctrl-C: in-flight requests finish, then the process exits 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, name="vitlab-serve-http", daemon=True)
    thread.start()
    print(f"vitlab serve: listening on {server.url} (POST /predict with images; GET /health, /info); "
          "Ctrl-C stops", file=sys.stderr, flush=True)
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    server.close()
    if not args.quiet:
        health = server.health()
        images, batches = health["images"], health["batches"]
        print(f"vitlab serve: stopped after {images} image{'s' * (images != 1)} in {batches} "
              f"batch{'es' * (batches != 1)}",
              file=sys.stderr)
    return 0
