"""`vitlab engines WEIGHTS [--clean]`: the engine folders kept beside a model, and removing those that the weights
as they load now no longer use (vitlab.engine.folders)."""

from __future__ import annotations

import argparse

from vitlab.commands._load_args import WEIGHTS_HELP, add_load_arguments, load_overrides, parse_image_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "engines", help="list the engine files kept for a model (ONNX Runtime, OpenVINO, compiled kernels) and remove old ones",
        description="predict, evaluate and serve keep the engines they build (ONNX graphs, OpenVINO models, int8 "
                    "graphs) beside the model, in MODEL/engines/<hash> (FILE.engines/<hash> for a file), one folder "
                    "per weights and load settings; --engine compiled keeps its kernels in the user cache "
                    "($VITLAB_CACHE/engines/<hash>). This lists them with their size, and with --clean removes the "
                    "ones built for other weights or settings (a run trained further, a replaced file, another "
                    "--image-size or --model-args than given here); they are built again if needed.")
    p.add_argument("weights", help="whose engines; " + WEIGHTS_HELP)
    p.add_argument("--image-size", type=parse_image_size, default=None,
                   help="S or HxW: the size the commands load the model at (their --image-size), if not its own")
    add_load_arguments(p)
    p.add_argument("--clean", action="store_true",
                   help="remove the folders that the weights as loaded here do not use")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vitlab.engine.choose import artefact_folder
    from vitlab.engine.folders import compiled_caches, describe, engine_folders, remove_folder
    from vitlab.weights import load_with_meta, resolve_model
    from vitlab.weights.hub import cache_dir

    overrides, image_size = load_overrides(args)
    model, _ = load_with_meta(args.weights, image_size=image_size, **overrides)
    current = artefact_folder(model, resolve_model(args.weights))
    folders = engine_folders(current)
    cache_engines = cache_dir() / "engines"
    if current.parent == cache_engines:  # the user cache holds every cached model's: this one's only
        folders = [f for f in folders if f.current]
    else:  # its compiled engine's kernels, which stay in the user cache
        folders += compiled_caches(current, folders, cache_engines)
    if not folders:
        print(f"no engines kept for {args.weights} (predict, evaluate and serve build them with --engine auto, "
              f"onnxruntime, openvino or compiled, or --int8; they would go to {current}, compiled kernels to "
              f"{cache_engines / current.name})")
        return 0
    print(f"engines of {args.weights} in {current.parent}"
          + (f" (and compiled kernels in {cache_engines})" if any(f.in_user_cache for f in folders) else "") + ":")
    for folder in folders:
        print("  " + describe(folder))
    others = [f for f in folders if not f.current]
    freed = sum(f.size for f in others) / 2**20
    if args.clean:
        for folder in others:
            remove_folder(folder)
        print(f"removed {len(others)} folder{'s' * (len(others) != 1)} of other weights or settings ({freed:.1f} MB)")
    elif others:
        print(f"{len(others)} folder{'s' * (len(others) != 1)} ({freed:.1f} MB) {'were' if len(others) != 1 else 'was'} "
              f"built for other weights or settings: `vitlab engines {args.weights} --clean` removes "
              f"{'them' if len(others) != 1 else 'it'}")
    return 0
