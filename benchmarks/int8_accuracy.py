"""int8 against fp32 on real data: accuracy, top-1 agreement and speed of what `--int8 static|dynamic` builds, in
ONNX Runtime and, where installed, OpenVINO (static int8 with the rest in fp32, and in bf16 where the CPU has it).

    python benchmarks/int8_accuracy.py                                  # the documented Fashion-MNIST ViT, full test set
    python benchmarks/int8_accuracy.py --model RUN/model --data DATA --calibration 256

Static int8 is calibrated on images of the training split (never the test set); both int8 graphs are scored on
the whole test split against the same model in eager fp32.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from vitlab.data import load_data
from vitlab.engine import prepare_engine
from vitlab.engine.calibration import calibration_from_dataset
from vitlab.predict import preprocess_for
from vitlab.weights import load_with_meta

KEPT = Path(__file__).resolve().parents[1] / "docs" / "figures" / "fmnist_vit_model"


BATCH = 256  # images per engine call


def logits_of(engine, x: torch.Tensor, batch: int = BATCH) -> tuple[np.ndarray, float]:
    # One untimed call first, for every engine alike. Until 2026-11-27 the fp32 reference was timed from its very
    # first call (the process's first model work, and the engine's first use), while the int8 engines had already
    # run when `prepare_engine` timed its candidates: the images/s column leaned towards int8.
    engine(x[:batch])
    start = time.perf_counter()
    out = torch.cat([engine(x[i:i + batch]) for i in range(0, len(x), batch)]).numpy()
    return out, len(x) / (time.perf_counter() - start)


def int8_engines(model, calibration, folder):
    """Every int8 variant `--int8` may run, each as it runs it at this script's batch (in sub-batches where those
    timed faster: engine/sub_batch.py), calibrated on the same images."""
    from vitlab.engine.choose import int8_candidates

    for mode in ("static", "dynamic"):
        yield prepare_engine(model, "onnxruntime", int8=mode, calibration=calibration, source=folder, quiet=True,
                             batch_size=BATCH)
    for variant in (m for m in int8_candidates("auto", "static") if m.startswith("openvino")):
        yield openvino_int8(model, calibration, folder, variant)


def openvino_int8(model, calibration, folder, variant: str):
    """One OpenVINO int8 variant (`--int8 static --engine openvino` times them and keeps the faster), calibrated on
    the same three quarters of `calibration` as `prepare_engine` uses, in its best sub-batches."""
    from vitlab.engine import choose

    builder = choose._Builder(model, choose.artefact_folder(model, folder), tuple(model.config.image_size),
                              torch.get_num_threads())
    engine = builder.int8(variant, choose._split_calibration(calibration)[0])
    return choose._in_best_sub_batches(engine, builder, BATCH, [], lambda text: None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(KEPT))
    ap.add_argument("--data", default="fashion-mnist")
    ap.add_argument("--calibration", type=int, default=256, help="training images for static int8 (default 256)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, meta = load_with_meta(args.model)
    pre = preprocess_for(model, meta)
    splits = load_data(args.data, progress=False, report=False)
    test = splits.test
    x = torch.cat([pre.batch(torch.stack([test[j][0] for j in range(i, min(i + 500, len(test)))]))
                   for i in range(0, len(test), 500)])
    y = np.array([int(test[j][1]) for j in range(len(test))])
    calibration = calibration_from_dataset(splits.train, pre, limit=args.calibration)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ref_logits, ref_speed = logits_of(prepare_engine(model, "torch", source=tmp, quiet=True), x)
        ref = ref_logits.argmax(1)
        rows.append({"engine": "torch fp32", "accuracy": float((ref == y).mean()), "agreement": 1.0,
                     "images_per_s": ref_speed})
        for engine in int8_engines(model, calibration, tmp):
            out, speed = logits_of(engine, x)
            pred = out.argmax(1)
            rows.append({"engine": engine.name, "accuracy": float((pred == y).mean()),
                         "agreement": float((pred == ref).mean()), "images_per_s": speed,
                         "max_abs_logit_diff": float(np.abs(out - ref_logits).max()),
                         "sub_batch": getattr(engine, "size", None)})
    print(f"{args.model} on {args.data} test ({len(y)} images); static calibrated on {args.calibration} training images")
    for r in rows:
        print(f"  {r['engine']:26s} accuracy {100 * r['accuracy']:6.2f} %  ({100 * (r['accuracy'] - rows[0]['accuracy']):+.2f} "
              f"points vs fp32)  top-1 agreement with fp32 {100 * r['agreement']:6.2f} %  {r['images_per_s']:8.0f} images/s"
              + (f"  (batches of {BATCH} in sub-batches of {r['sub_batch']})" if r.get("sub_batch") else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
