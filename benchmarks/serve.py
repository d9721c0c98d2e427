"""`vitlab serve` under load: images/s and latency with request batching (`--max-batch 32`) against one image per
model call (`--max-batch 1`), for 1 and for many concurrent clients, and the engine's own speed at batch 1 and
32 as the ceiling.

Each server runs in its own process (`vitlab serve ... --port 0`), all of them at once, and the rounds are
interleaved; the clients are threads of this process, each sending one 224 px JPEG per request over a kept-alive
connection, as fast as answers come. On a 2-core machine the clients take some of the CPU the server could use.

    python benchmarks/serve.py                                   # ViT-Ti/16, int8 dynamic and fp32 (auto engine)
    python benchmarks/serve.py --model vit-s/16 --clients 1,32 --seconds 10
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import vitlab
from vitlab.weights import save_native


def start_server(weights: Path, flags: list[str], threads: int) -> tuple[subprocess.Popen, str, int]:
    """A `vitlab serve` process on a free port; returns it with its host and port once it listens."""
    cmd = [sys.executable, "-m", "vitlab", "serve", str(weights), "--port", "0", "--quiet",
           "--threads", str(threads), *flags]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        found = re.search(r"listening on http://([\d.]+):(\d+)", line)
        if found:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
            return proc, found.group(1), int(found.group(2))
    raise RuntimeError(f"{' '.join(cmd)} exited with {proc.wait()}")


def load(host: str, port: int, image: bytes, clients: int, seconds: float) -> dict:
    """`clients` threads posting `image` back to back for `seconds`: images/s and latency percentiles."""
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def client() -> None:
        conn = http.client.HTTPConnection(host, port, timeout=120)
        mine = []
        while time.perf_counter() < stop:
            start = time.perf_counter()
            conn.request("POST", "/predict?top_k=1", body=image, headers={"Content-Type": "image/jpeg"})
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                raise RuntimeError(f"{response.status}: {body[:200]!r}")
            mine.append(time.perf_counter() - start)
        conn.close()
        with lock:
            latencies.extend(mine)

    began = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    ms = sorted(1e3 * x for x in latencies)
    return {"images_s": len(ms) / elapsed, "p50_ms": ms[len(ms) // 2], "p95_ms": ms[int(0.95 * (len(ms) - 1))]}


def health(host: str, port: int) -> dict:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/health")
    doc = json.loads(conn.getresponse().read())
    conn.close()
    return doc


def engine_ceiling(weights: Path, int8: str | None, threads: int) -> dict[int, float]:
    """The engine alone (no HTTP, no decoding) at batch 1 and 32, images/s: what serving can approach."""
    from vitlab.engine import prepare_engine
    from vitlab.engine.choose import interleaved_speeds

    torch.set_num_threads(threads)
    model = vitlab.load(weights).eval()
    engine = prepare_engine(model, "auto", int8=int8, batch_size=32, source=weights, quiet=True)
    out = {}
    for batch in (1, 32):
        out[batch] = interleaved_speeds({"e": engine}, torch.randn(batch, 3, 224, 224), rounds=5)["e"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit-ti/16")
    ap.add_argument("--clients", default="1,16", help="concurrent clients, comma-separated")
    ap.add_argument("--seconds", type=float, default=6.0, help="per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", help="also write the results as JSON here")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "model"
        torch.manual_seed(0)
        model = vitlab.create_model(args.model, num_classes=10)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)  # random weights (speed does not depend on them), no ties
        save_native(model, weights, class_names=[f"class {i}" for i in range(10)])
        photo = io.BytesIO()
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (256, 320, 3), dtype=np.uint8)).save(
            photo, format="JPEG", quality=90)
        image = photo.getvalue()
        engines = {"int8 dynamic": ["--int8", "dynamic"], "fp32 (auto engine)": []}
        settings = {(e, b): flags + ["--max-batch", str(b), "--max-wait-ms", "5"]
                    for e, flags in engines.items() for b in (1, 32)}
        ceilings = {e: engine_ceiling(weights, "dynamic" if flags else None, args.threads)
                    for e, flags in engines.items()}
        servers = {key: start_server(weights, flags, args.threads) for key, flags in settings.items()}
        try:
            runs: dict = {}
            for _ in range(args.rounds):
                for key, (_, host, port) in servers.items():
                    for c in clients:
                        runs.setdefault((*key, c), []).append(load(host, port, image, c, args.seconds))
            batches = {key: health(host, port)["mean_batch"] for key, (_, host, port) in servers.items()}
        finally:
            for proc, _, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    print(f"{args.model}, {args.threads} threads, torch {torch.__version__}, median of {args.rounds} rounds of "
          f"{args.seconds:g} s; 224 px model, {len(image) // 1024} KB JPEG of 320x256 per request")
    print(f"{'engine':20s} {'--max-batch':>11s} {'clients':>7s} {'images/s':>9s} {'p50 ms':>8s} {'p95 ms':>8s}"
          f"  engine alone at batch 1 / 32 (images/s)")
    results = []
    for (engine, batch, c), rows in runs.items():
        row = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        ceiling = ceilings[engine]
        print(f"{engine:20s} {batch:11d} {c:7d} {row['images_s']:9.1f} {row['p50_ms']:8.1f} {row['p95_ms']:8.1f}"
              f"  {ceiling[1]:.1f} / {ceiling[32]:.1f}")
        results.append({"engine": engine, "max_batch": batch, "clients": c, **row,
                        "engine_batch1_images_s": ceiling[1], "engine_batch32_images_s": ceiling[32]})
    print("mean batch over the whole run: " + ", ".join(f"{e} --max-batch {b}: {m}" for (e, b), m in batches.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "threads": args.threads, "rows": results,
                                              "mean_batch": {f"{e} --max-batch {b}": m
                                                             for (e, b), m in batches.items()}}, indent=1))


if __name__ == "__main__":
    main()
