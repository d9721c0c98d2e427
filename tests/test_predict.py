"""`vitlab predict`: class names and probabilities with the stored preprocessing; table/json/csv; clear errors."""

import csv
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.cli import main
from vitlab.data.preprocess import Preprocess
from vitlab.errors import VitlabError
from vitlab.models.registry import create_model
from vitlab.weights import save_native

NAMES = ["apple", "banana", "cherry", "date", "elder", "fig"]


@pytest.fixture()
def setup(tmp_path):
    model = create_model("custom", dim=32, depth=1, heads=4, mlp_dim=64, patch_size=4, image_size=16,
                         num_classes=len(NAMES), seed=0).eval()
    with torch.no_grad():
        model.head.weight.normal_(std=2.0, generator=torch.Generator().manual_seed(0))
    pre = Preprocess(image_size=(16, 16), mean=(0.2, 0.4, 0.6), std=(0.3, 0.2, 0.1))
    save_native(model, tmp_path / "w", class_names=NAMES, preprocess=pre)
    rng = np.random.default_rng(0)
    imgs = tmp_path / "imgs"
    (imgs / "sub").mkdir(parents=True)
    arrays = {}
    for name in ("a.png", "b.png", "sub/c.png"):
        arr = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)  # already at the model size: no resize
        Image.fromarray(arr).save(imgs / name)
        arrays[str(imgs / name)] = arr
    (imgs / "notes.txt").write_text("not an image")
    return model, tmp_path, imgs, arrays


def _reference_probs(model, arr):
    """Preprocessing by hand: (x / 255 - mean) / std with the stored numbers."""
    x = (arr.astype(np.float32) / 255.0 - np.array([0.2, 0.4, 0.6], np.float32)) / np.array([0.3, 0.2, 0.1], np.float32)
    with torch.no_grad():
        return model(torch.from_numpy(x.transpose(2, 0, 1))[None]).softmax(-1)[0].numpy()


def test_predict_json_matches_reference(setup, capsys):
    model, tmp, imgs, arrays = setup
    assert main(["predict", str(tmp / "w"), str(imgs), "--top-k", "3", "--format", "json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(r["path"] for r in out) == sorted(arrays)
    for r in out:
        ref = _reference_probs(model, arrays[r["path"]])
        order = np.argsort(-ref)[:3]
        assert [t["label"] for t in r["top"]] == [NAMES[i] for i in order]
        assert np.allclose([t["probability"] for t in r["top"]], ref[order], atol=1e-5)


def test_predict_csv_and_table(setup, capsys):
    model, tmp, imgs, arrays = setup
    a = str(imgs / "a.png")
    assert main(["predict", str(tmp / "w"), a, "--format", "csv", "--top-k", "10"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == len(NAMES) and [int(r["rank"]) for r in rows] == list(range(1, 7))
    ref = _reference_probs(model, arrays[a])
    assert np.isclose(float(rows[0]["probability"]), ref.max(), atol=1e-5) and rows[0]["label"] == NAMES[ref.argmax()]
    assert main(["predict", str(tmp / "w"), a]) == 0
    table = capsys.readouterr().out
    assert a in table and f"{100 * ref.max():.2f}%" in table and NAMES[ref.argmax()] in table


def _err(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    return err


def test_predict_errors_are_one_line(setup, capsys):
    _, tmp, imgs, _ = setup
    assert main(["predict", str(tmp / "nope"), str(imgs / "a.png")]) == 2
    assert _err(capsys)[-1].startswith("vitlab predict: error: no such file or folder")
    (tmp / "weights.txt").write_text("hello")
    assert main(["predict", str(tmp / "weights.txt"), str(imgs / "a.png")]) == 2
    assert "unknown checkpoint format" in _err(capsys)[-1]
    data = (tmp / "w" / "model.safetensors").read_bytes()
    (tmp / "trunc").mkdir()
    (tmp / "trunc" / "config.json").write_text((tmp / "w" / "config.json").read_text())
    (tmp / "trunc" / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert main(["predict", str(tmp / "trunc"), str(imgs / "a.png")]) == 2
    assert "complete" in _err(capsys)[-1]
    (imgs / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)
    assert main(["predict", str(tmp / "w"), str(imgs / "broken.png")]) == 2
    assert len(_err(capsys)) == 1
    assert main(["predict", str(tmp / "w"), str(imgs)]) == 2  # a folder: the line names the way past it
    assert _err(capsys)[-1].endswith("broken.png; add --skip-bad to leave unreadable images out")
    assert main(["predict", str(tmp / "w"), str(imgs), "--skip-bad", "--format", "json"]) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)) == 3 and "broken.png" in captured.err
    assert main(["predict", str(imgs / "a.png"), str(tmp / "w")]) == 2  # swapped: said before the images fail
    assert _err(capsys)[-1].endswith("a.png is an image, not weights: the weights come first "
                                     "(`vitlab predict WEIGHTS IMAGES`)")
    (tmp / "m.onnx").write_bytes(b"\x08\x07")
    assert main(["predict", str(tmp / "m.onnx"), str(imgs / "a.png")]) == 2
    assert "m.onnx is an exported model (ONNX / OpenVINO): vitlab writes such files but does not load them" in \
        _err(capsys)[-1]
    assert main(["predict", str(tmp / "w"), str(tmp / "missing.png")]) == 2
    assert "no such image" in _err(capsys)[-1]


@pytest.mark.parametrize("processor_kind, shape", [("ViTImageProcessor", (16, 16, 3)),
                                                    ("DeiTImageProcessor", (30, 52, 3)),
                                                    ("CLIPImageProcessor", (44, 24, 3)),
                                                    ("CLIPImageProcessor", (30, 35, 3))])
def test_predict_hf_folder_uses_its_preprocessing(tmp_path, capsys, processor_kind, shape):
    """vitlab predict on a Hugging Face folder gives transformers' own probabilities (its processor, its model),
    for a plain resize, DeiT's squash + crop and CLIP's shortest edge + crop, on photos of other shapes (30x35:
    20x23 after the resize, a margin of 7, where transformers' crop starts at 3 and torchvision's at 4)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                 image_size=16, patch_size=4, num_labels=3, id2label={0: "x", 1: "y", 2: "z"},
                                 label2id={"x": 0, "y": 1, "z": 2})
    torch.manual_seed(0)
    hf = transformers.ViTForImageClassification(cfg).eval()
    with torch.no_grad():  # outputs far from uniform, so that other pixels give other probabilities
        for p in hf.parameters():
            p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path / "hf")
    kinds = {"ViTImageProcessor": dict(size={"height": 16, "width": 16}),
             "DeiTImageProcessor": dict(size={"height": 20, "width": 20}, crop_size={"height": 16, "width": 16}),
             "CLIPImageProcessor": dict(size={"shortest_edge": 20}, crop_size={"height": 16, "width": 16},
                                        do_convert_rgb=False)}
    cls = getattr(transformers, processor_kind.replace("ImageProcessor", "ImageProcessorPil"), None) \
        or getattr(transformers, processor_kind)  # the PIL backend: transformers 5 without torchvision uses it too
    proc = cls(image_mean=[0.5] * 3, image_std=[0.5] * 3, **kinds[processor_kind])
    proc.save_pretrained(tmp_path / "hf")
    yy, xx = np.mgrid[0:shape[0], 0:shape[1]]  # smooth, with detail a crop and a squash place differently
    arr = np.stack([xx * 255 // xx.max(), yy * 255 // yy.max(), (xx * yy) * 255 // (xx * yy).max()], -1)
    arr = arr.astype(np.uint8)
    Image.fromarray(arr).save(tmp_path / "img.png")
    assert main(["predict", str(tmp_path / "hf"), str(tmp_path / "img.png"), "--format", "json", "--top-k", "3"]) == 0
    top = json.loads(capsys.readouterr().out)[0]["top"]
    with torch.no_grad():  # transformers' own processor and model
        ref = hf(**proc(images=Image.open(tmp_path / "img.png"), return_tensors="pt")).logits.softmax(-1)[0].numpy()
    order = np.argsort(-ref)
    assert [t["label"] for t in top] == [["x", "y", "z"][i] for i in order]
    assert np.allclose([t["probability"] for t in top], ref[order], atol=1e-5 if processor_kind == "ViTImageProcessor"
                       else 2e-3)  # PIL's 8-bit resize and torch's differ by a level or so


@pytest.mark.parametrize("workers", [0, 2])
def test_images_read_ahead_come_in_order_with_their_errors(workers):
    from vitlab.errors import VitlabError
    from vitlab.predict import prefetched

    def work(i):
        if i == 7:
            raise VitlabError("bad image 7")
        return i * i

    seen = []
    for item, future in prefetched(list(range(20)), work, ahead=4, workers=workers):
        if item == 7:
            with pytest.raises(VitlabError, match="bad image 7"):
                future.result()
        else:
            seen.append((item, future.result()))
    assert seen == [(i, i * i) for i in range(20) if i != 7]


def test_reading_ahead_stops_when_the_caller_stops():
    import threading
    import time

    from vitlab.predict import prefetched

    calls = []
    lock = threading.Lock()

    def work(i):
        with lock:
            calls.append(i)
        time.sleep(0.01)
        return i

    stream = prefetched(list(range(200)), work, ahead=4, workers=2)
    assert [next(stream)[1].result() for _ in range(3)] == [0, 1, 2]
    stream.close()  # a bad image in strict mode: the rest is not read
    assert len(calls) <= 3 + 4 + 2


def test_calibration_images_are_read_ahead_in_order_and_bad_ones_skipped(setup):
    from vitlab.data.images import open_image
    from vitlab.engine.calibration import calibration_from_files
    from vitlab.predict import collect_images

    _, tmp, imgs, _ = setup
    files = collect_images([imgs])[0]
    bad = tmp / "broken.png"
    bad.write_bytes(b"not a png")
    pre = Preprocess(image_size=(16, 16), mean=(0.2, 0.4, 0.6), std=(0.3, 0.2, 0.1))
    [batch] = calibration_from_files([files[0], bad, *files[1:]], pre)
    expected = torch.stack([pre(open_image(f)) for f in files]).numpy()
    assert batch.shape == (3, 3, 16, 16) and np.array_equal(batch, expected)


def test_cpu_engine_flags_run_on_the_cpu_of_a_gpu_machine(setup, capsys, monkeypatch):
    """On a machine with a GPU, `--device auto` with --engine onnxruntime or --int8 runs on the CPU (those
    engines run nowhere else) instead of refusing, as the serve tests found on an H200; a GPU asked for by name
    with such a flag is refused in one line."""
    pytest.importorskip("onnxruntime")
    model, tmp, imgs, arrays = setup
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what `auto` sees on a GPU machine
    assert main(["predict", str(tmp / "w"), str(imgs / "a.png"), "--engine", "onnxruntime", "--format", "json",
                 "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    probs = {p["label"]: p["probability"] for p in out[0]["top"]}
    ref = _reference_probs(model, arrays[str(imgs / "a.png")])
    assert probs[NAMES[int(ref.argmax())]] == pytest.approx(float(ref.max()), abs=1e-4)
    assert main(["predict", str(tmp / "w"), str(imgs / "a.png"), "--engine", "onnxruntime", "--device", "cuda"]) == 2
    assert "runs on the CPU" in capsys.readouterr().err


def test_a_quoted_pattern_is_expanded(setup, capsys):
    """`vitlab predict W 'imgs/*.png'` (or any shell that does not expand patterns) said no such file."""
    model, tmp, imgs, arrays = setup
    assert main(["predict", str(tmp / "w"), str(imgs / "*.png"), "--format", "json", "--quiet"]) == 0
    assert sorted(r["path"] for r in json.loads(capsys.readouterr().out)) == [str(imgs / "a.png"), str(imgs / "b.png")]
    assert main(["predict", str(tmp / "w"), str(imgs / "**" / "*.png"), "--format", "json", "--quiet"]) == 0
    assert sorted(r["path"] for r in json.loads(capsys.readouterr().out)) == sorted(arrays)
    assert main(["predict", str(tmp / "w"), str(imgs / "*.jpg")]) == 2
    assert f"no image file matches {imgs / '*.jpg'}" in capsys.readouterr().err


def test_the_python_predict_takes_the_engines(setup):
    """`vitlab.predict.predict` ran eager PyTorch only: the Python route to the CLI's engines and int8."""
    pytest.importorskip("onnxruntime")
    from vitlab.predict import predict

    model, tmp, imgs, arrays = setup
    eager = predict(tmp / "w", [imgs], top_k=3)
    assert sorted(p.path for p in eager) == sorted(arrays)
    for engine in ("onnxruntime", "auto"):
        other = predict(tmp / "w", [imgs], top_k=3, engine=engine)
        assert [p.labels for p in other] == [p.labels for p in eager]
        assert np.allclose([p.probs for p in other], [p.probs for p in eager], atol=1e-5)
    calib = tmp / "calib"
    calib.mkdir()
    for i in range(20):
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(calib / f"{i}.png")
    q = predict(tmp / "w", [imgs / "*.png"], top_k=1, int8="static", engine="onnxruntime", calibration=calib)
    assert len(q) == 2 and q[0].labels[0] in NAMES
    with pytest.raises(VitlabError, match="static int8 needs calibration images"):
        predict(tmp / "w", [imgs], int8="static", engine="onnxruntime")


def test_colour_images_given_to_a_grey_model_are_said_once(tmp_path, capsys):
    """A colour photo given to the grey 28 px Fashion-MNIST model was converted without a word."""
    model = create_model("custom", dim=16, depth=1, heads=2, mlp_dim=32, patch_size=4, image_size=16, in_chans=1,
                         num_classes=3, seed=0).eval()
    save_native(model, tmp_path / "grey", class_names=["a", "b", "c"],
                preprocess=Preprocess(image_size=(16, 16), mean=(0.5,), std=(0.5,), channels=1))
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(tmp_path / "photo.png")
    grey = rng.integers(0, 256, (16, 16), dtype=np.uint8)
    Image.fromarray(np.stack([grey] * 3, axis=-1)).save(tmp_path / "grey-as-rgb.png")  # an RGB file, grey inside
    assert main(["predict", str(tmp_path / "grey"), str(tmp_path / "grey-as-rgb.png"), "--quiet"]) == 0
    assert "colour image" not in capsys.readouterr().err
    assert main(["predict", str(tmp_path / "grey"), str(tmp_path / "photo.png"), str(tmp_path / "grey-as-rgb.png"),
                 "--quiet"]) == 0
    assert "the model takes grey images: 1 colour image (photo.png) converted to grey" in capsys.readouterr().err
