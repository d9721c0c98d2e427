"""What decoding a JPEG costs before a ViT sees it, full (`vitlab predict`, `vitlab serve`) and with
`vitlab serve --fast-jpeg` (libjpeg's DCT scaling down to at least twice the model's input, then the same resize),
and how far apart the two model inputs are, in levels of 255.

The photos are synthetic (noise at several scales, so that every JPEG frequency band holds detail), saved at
quality 90: no labelled photos are at hand here, so this measures speed and the input difference. `--accuracy`
measures what `--fast-jpeg` does to accuracy on the one labelled set at hand: the Fashion-MNIST test images,
enlarged (bicubic) to `--enlarge` times their 28 px and saved as JPEG at quality 90, classified by the documented
Fashion-MNIST ViT after a full decode and after `--fast-jpeg`'s reduced one.

    python benchmarks/decode.py
    python benchmarks/decode.py --image-size 384 --rounds 9
    python benchmarks/decode.py --predict 12     # `vitlab predict` on 12 such 12-megapixel photos: reading
                                                 # ahead in 2 threads (READ_AHEAD_WORKERS) against in turn
    python benchmarks/decode.py --accuracy 10000 # accuracy and top-1 agreement, full decode vs --fast-jpeg
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


KEPT_MODEL = "docs/figures/fmnist_vit_model"  # the documented Fashion-MNIST ViT (docs/RESULTS.md)


def enlarged_jpeg(image: torch.Tensor, factor: int) -> bytes:
    """A (1, 28, 28) uint8 image enlarged `factor` times (bicubic) and saved as a quality-90 JPEG."""
    img = Image.fromarray(image[0].numpy())
    img = img.resize((img.width * factor, img.height * factor), Image.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def fast_jpeg_accuracy(count: int, factor: int) -> None:
    from vitlab.data import load_data
    from vitlab.weights import load_with_meta

    model, meta = load_with_meta(KEPT_MODEL)
    model.eval()
    full, fast = ImageClassifier(model, meta), ImageClassifier(model, meta, fast_jpeg=True)
    test = load_data("fashion-mnist", progress=False, report=False).test
    count = min(count, len(test))
    labels = torch.tensor([int(test[i][1]) for i in range(count)])
    preds: dict[str, list[torch.Tensor]] = {"original 28 px": [], "full decode": [], "--fast-jpeg": []}
    level_diffs = []
    levels = 255 * full.preprocess.std[0]
    for start in range(0, count, 500):
        batch = [test[i][0] for i in range(start, min(start + 500, count))]
        jpegs = [enlarged_jpeg(image, factor) for image in batch]
        inputs = {"original 28 px": full.preprocess.batch(torch.stack(batch)),
                  "full decode": torch.stack([full.tensor(j, "image") for j in jpegs]),
                  "--fast-jpeg": torch.stack([fast.tensor(j, "image") for j in jpegs])}
        level_diffs.append(((inputs["full decode"] - inputs["--fast-jpeg"]).abs() * levels).flatten(1).amax(1))
        with torch.inference_mode():
            for key, x in inputs.items():
                preds[key].append(model(x).argmax(1))
    decoded = Image.open(io.BytesIO(jpegs[0]))  # every image has the same size: so has its reduced decode
    decoded.draft(None, fast.draft)
    got = {k: torch.cat(v) for k, v in preds.items()}
    diffs = torch.cat(level_diffs)
    side = 28 * factor
    print(f"{KEPT_MODEL} on the first {count} Fashion-MNIST test images, enlarged to {side}x{side} JPEG (quality 90); "
          f"--fast-jpeg decodes them at {decoded.size[0]}x{decoded.size[1]}; input difference full vs fast: "
          f"median of the per-image max {float(diffs.median()):.2f}, largest {float(diffs.max()):.2f} levels of 255")
    for key, pred in got.items():
        agreement = float((pred == got["full decode"]).float().mean())
        print(f"  {key:15s} accuracy {100 * float((pred == labels).float().mean()):6.2f} %   "
              f"top-1 agreement with the full decode {100 * agreement:6.2f} %")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--predict", type=int, default=0, help="time `vitlab predict` on this many photos instead")
    ap.add_argument("--accuracy", type=int, default=0,
                    help="accuracy with and without --fast-jpeg on this many Fashion-MNIST test images instead")
    ap.add_argument("--enlarge", type=int, default=16, help="with --accuracy: enlarge the 28 px images this much")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.accuracy:
        fast_jpeg_accuracy(args.accuracy, args.enlarge)
        return
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
