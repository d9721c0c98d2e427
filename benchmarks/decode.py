"""What decoding a JPEG costs before a ViT sees it, full (`vitlab predict`, `vitlab serve`) and with
`vitlab serve --fast-jpeg` (libjpeg's DCT scaling down to at least twice the model's input, then the same resize),
and how far apart the two model inputs are, in levels of 255.

The photos are synthetic (noise at several scales, so that every JPEG frequency band holds detail), saved at
quality 90: no labelled photos are at hand here, so this measures speed and the input difference, not accuracy.

    python benchmarks/decode.py
    python benchmarks/decode.py --image-size 384 --rounds 9
    python benchmarks/decode.py --predict 12     # `vitlab predict` on 12 such 12-megapixel photos: reading
                                                 # ahead in 2 threads (READ_AHEAD_WORKERS) against in turn
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import numpy as np
import torch
from PIL import Image

import vitlab
from vitlab.serve import ImageClassifier

SIZES = ((640, 480), (1920, 1080), (4032, 3024))


def photo(width: int, height: int, seed: int = 0) -> bytes:
    """A JPEG with detail at every scale: noise upsampled from 1/64, 1/8 and full size, summed."""
    rng = np.random.default_rng(seed)
    out = np.zeros((height, width, 3), np.float32)
    for factor, weight in ((64, 0.5), (8, 0.3), (1, 0.2)):
        small = rng.integers(0, 256, (max(height // factor, 1), max(width // factor, 1), 3), dtype=np.uint8)
        out += weight * np.asarray(Image.fromarray(small).resize((width, height), Image.BICUBIC), np.float32)
    buf = io.BytesIO()
    Image.fromarray(out.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def median_ms(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_predict(count: int, rounds: int) -> None:
    """`predict_files` (what `vitlab predict` runs, eager PyTorch) over `count` 4032x3024 photos, images read in
    turn against read ahead in threads; interleaved rounds, median seconds."""
    import tempfile
    from pathlib import Path

    import vitlab.predict as predict

    model = vitlab.create_model("vit-ti/16", num_classes=10).eval()
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i in range(count):
            files.append(Path(tmp) / f"photo{i}.jpg")
            files[-1].write_bytes(photo(4032, 3024, seed=i))
        seconds: dict[int, list[float]] = {0: [], predict.READ_AHEAD_WORKERS: []}
        outputs = {}
        for _ in range(rounds):
            for workers in seconds:
                predict.READ_AHEAD_WORKERS, default = workers, predict.READ_AHEAD_WORKERS
                start = time.perf_counter()
                outputs[workers] = predict.predict_files(model, {}, files, batch_size=8)[0]
                seconds[workers].append(time.perf_counter() - start)
                predict.READ_AHEAD_WORKERS = default
        same = all(a.probs == b.probs for a, b in zip(*outputs.values()))
        (before, *_), (after, *_) = ([statistics.median(v)] for v in seconds.values())
        print(f"predict {count} photos of 4032x3024 (ViT-Ti/16, batch 8, {torch.get_num_threads()} threads), median of "
              f"{rounds}: read in turn {before:.2f} s, read ahead in {max(seconds)} threads {after:.2f} s "
              f"({before / after:.2f}x); the same probabilities: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--predict", type=int, default=0, help="time `vitlab predict` on this many photos instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.predict:
        time_predict(args.predict, args.rounds)
        return
    model = vitlab.create_model("vit-ti/16", image_size=args.image_size, num_classes=10)
    full, fast = ImageClassifier(model, {}), ImageClassifier(model, {}, fast_jpeg=True)
    levels = 255 * full.preprocess.std[0]  # normalised units -> levels of 255 (std 0.5 for every channel here)
    print(f"{args.image_size} px model input, {args.threads} threads, torch {torch.__version__}, median of "
          f"{args.rounds}; decode + preprocess per image")
    print(f"{'photo':>10s} {'JPEG KB':>8s} {'full ms':>8s} {'--fast-jpeg ms':>15s} {'speed-up':>9s} "
          f"{'decoded at':>11s} {'max diff':>9s} {'mean diff':>10s} (levels of 255)")
    for width, height in SIZES:
        data = photo(width, height)
        a, b = full.tensor(data, "photo"), fast.tensor(data, "photo")
        decoded = Image.open(io.BytesIO(data))
        decoded.draft(None, fast.draft)
        t_full = median_ms(lambda: full.tensor(data, "photo"), args.rounds)  # noqa: B023 - called at once
        t_fast = median_ms(lambda: fast.tensor(data, "photo"), args.rounds)  # noqa: B023
        diff = (a - b).abs() * levels
        print(f"{width:>5d}x{height:<4d} {len(data) // 1024:8d} {t_full:8.1f} {t_fast:15.1f} {t_full / t_fast:8.1f}x "
              f"{decoded.size[0]:>5d}x{decoded.size[1]:<5d} {float(diff.max()):9.2f} {float(diff.mean()):10.3f}")


if __name__ == "__main__":
    main()
