"""What a server holds in memory: `vitlab serve` with each engine against the peers' own serving processes.

    /work/peers/bin/python benchmarks/serve_memory.py                         # ViT-B/16, vitlab's engines and peers
    /work/peers/bin/python benchmarks/serve_memory.py --src /tmp/old/src      # also vitlab from another checkout
    .venv/bin/python benchmarks/serve_memory.py --engines torch,onnxruntime   # vitlab's rows only (no timm here)

Every row is a fresh process that gets ready to serve the same model (random weights): it warms up at the
server's batch (`--max-batch`, vitlab serve's default 32) and answers one image. Then its /proc/PID/status is
read: VmRSS (resident now), RssAnon (of it, memory the process allocated itself), RssFile (mapped files: shared
libraries, memory-mapped weights; the OS can drop these pages and read them again) and VmHWM (the peak). It is
read again after the process has answered a full batch (one request of `--max-batch` images), as a busy server
does: what an idle process gave back comes back there.

- `vitlab serve MODEL --engine E` for each engine, over HTTP as a user runs it (the engine's files are built by
  an untimed first start, as a server's first start builds them once);
- `timm eager`: timm's VisionTransformer of the same shape, `model(x)` under inference_mode;
- `transformers eager`: ViTForImageClassification.from_pretrained on its own saved folder;
- `ORT on timm's export`: a process that imports only onnxruntime and numpy and runs timm's ONNX export (the
  export is made once, beforehand): the smallest a Python server of this model can be.

Memory does not depend on the values, so random weights measure what published ones would. Run it on an idle
machine; the sizes move by a few MB between runs.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from predict_start import make_files  # the same random-weight model folder and 384x288 JPEG

FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
TIMM_NAMES = {"vit-ti/16": "vit_tiny_patch16_224", "vit-s/16": "vit_small_patch16_224",
              "vit-b/16": "vit_base_patch16_224", "vit-l/16": "vit_large_patch16_224"}

# The peers' processes: each prints its own /proc/self/status fields as JSON when it is ready to serve.
STATUS = f"""
import json
FIELDS = {FIELDS!r}
def status():
    out = {{}}
    for line in open('/proc/self/status'):
        key, _, value = line.partition(':')
        if key in FIELDS:
            out[key] = int(value.split()[0]) // 1024
    print(json.dumps(out))
"""
# A torch peer's `model` ready to serve: the warm-up batch and one image, then one more full batch
TORCH_WARM_UP = """
with torch.inference_mode():
    model(torch.zeros(int(sys.argv[2]), 3, 224, 224)); model(torch.zeros(1, 3, 224, 224))
    status()
    model(torch.zeros(int(sys.argv[2]), 3, 224, 224))
    status()
"""
TIMM_EAGER = STATUS + """
import sys, timm, torch
model = timm.create_model(sys.argv[1]).eval()
""" + TORCH_WARM_UP
HF_EAGER = STATUS + """
import sys, torch
from transformers import ViTForImageClassification
model = ViTForImageClassification.from_pretrained(sys.argv[1]).eval()
""" + TORCH_WARM_UP
ORT_ONLY = STATUS + """
import sys, numpy as np, onnxruntime as ort
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
session.run(None, {"images": np.zeros((int(sys.argv[2]), 3, 224, 224), np.float32)})
session.run(None, {"images": np.zeros((1, 3, 224, 224), np.float32)})
status()
session.run(None, {"images": np.zeros((int(sys.argv[2]), 3, 224, 224), np.float32)})
status()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in FIELDS:
                out[key] = int(value.split()[0]) // 1024
    return out


def serve_row(folder: Path, image: Path, engine: str, max_batch: int, env: dict) -> list[dict[str, int]]:
    """Start `vitlab serve`, wait until it answers, send one image, read its memory, send a request of `max_batch`
    images (one batch), read it again, stop it. `engine`: an `--engine` name, or NAME+int8 for `--engine NAME
    --int8 dynamic` (no calibration images needed)."""
    port = free_port()
    name, _, int8 = engine.partition("+")
    command = [sys.executable, "-m", "vitlab", "serve", str(folder), "--port", str(port), "--engine", name,
               "--max-batch", str(max_batch), "--quiet"] + (["--int8", "dynamic"] if int8 else [])
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 900  # a first start builds and times the engines
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vitlab serve --engine {engine} stopped: {server.stderr.read()[-2000:]}")
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        request = urllib.request.Request(url + "/predict", data=image.read_bytes(), method="POST")
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
        assert answer["results"][0]["top"], answer
        ready = proc_status(server.pid)
        batch = json.dumps({"images": [base64.b64encode(image.read_bytes()).decode()] * max_batch}).encode()
        request = urllib.request.Request(url + "/predict", data=batch, method="POST",
                                         headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=300).read())
        assert len(answer["results"]) == max_batch, answer
        return [ready, proc_status(server.pid)]
    finally:
        server.terminate()
        server.wait(timeout=60)


def peer_row(script: str, *args: str) -> list[dict[str, int]]:
    """The peer's memory when ready (its two status lines: then, and after one more full batch)."""
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], check=True, capture_output=True, text=True)
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-2:]]


def peer_files(work: Path, model: str) -> tuple[Path, Path]:
    """transformers' saved folder and timm's ONNX export (TorchScript exporter, dynamic batch) of the model's shape."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    import vitlab

    cfg = vitlab.create_model(model).config
    hf_folder, onnx_path = work / "hf", work / "timm.onnx"
    if not hf_folder.exists():
        ViTForImageClassification(ViTConfig(
            hidden_size=cfg.dim, num_hidden_layers=cfg.depth, num_attention_heads=cfg.heads,
            intermediate_size=cfg.mlp_dim, num_labels=cfg.num_classes)).save_pretrained(hf_folder)
    if not onnx_path.exists():
        import timm

        with torch.no_grad():
            torch.onnx.export(timm.create_model(TIMM_NAMES[model]).eval(), (torch.zeros(1, 3, 224, 224),),
                              str(onnx_path), input_names=["images"], output_names=["logits"], opset_version=17,
                              dynamo=False, dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}})
    return hf_folder, onnx_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit-b/16", choices=sorted(TIMM_NAMES))
    parser.add_argument("--engines", default="torch,onnxruntime,openvino,auto",
                        help="comma-separated --engine names; NAME+int8 adds --int8 dynamic (e.g. onnxruntime+int8)")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--src", type=Path, help="also run vitlab serve from this source tree (e.g. an older checkout)")
    parser.add_argument("--no-peers", action="store_true", help="vitlab's rows only")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "vitlab-serve-memory")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    folder, image = make_files(args.work, args.model)
    env = dict(os.environ)
    versions = [("this checkout", env)]
    if args.src is not None:
        versions.append((str(args.src), dict(env, PYTHONPATH=str(args.src.resolve()))))
    rows = []
    for label, version_env in versions:
        for engine in args.engines.split(","):
            serve_row(folder, image, engine, args.max_batch, version_env)  # builds (and for auto times) once
            flags = engine.replace("+int8", " --int8 dynamic")
            rows.append((f"vitlab serve --engine {flags} ({label})", serve_row(folder, image, engine,
                                                                                args.max_batch, version_env)))
    if not args.no_peers:
        hf_folder, onnx_path = peer_files(args.work, args.model)
        rows.append(("timm eager", peer_row(TIMM_EAGER, TIMM_NAMES[args.model], args.max_batch)))
        rows.append(("transformers eager", peer_row(HF_EAGER, hf_folder, args.max_batch)))
        rows.append(("ORT on timm's export (no torch imported)", peer_row(ORT_ONLY, onnx_path, args.max_batch)))
    print(f"{args.model}, MB (python {sys.version.split()[0]}, {os.cpu_count()} CPUs): ready to serve (after a "
          f"batch of {args.max_batch} and one image), then after one more batch of {args.max_batch}")
    loaded = ("VmRSS", "RssAnon", "VmHWM")
    print(f"| process | {' | '.join(FIELDS[:3])} | after a batch: {' | '.join(loaded)} |")
    print("|---|" + "---:|" * 6)
    for name, (ready, busy) in rows:
        print(f"| {name} | " + " | ".join(str(ready.get(k, "")) for k in FIELDS[:3]) + " | "
              + " | ".join(str(busy.get(k, "")) for k in loaded) + " |")


if __name__ == "__main__":
    main()
