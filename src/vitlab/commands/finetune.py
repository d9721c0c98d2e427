"""`vitlab finetune --weights W`: the paper's fine-tuning (SGD momentum 0.9, no weight decay,
warm-up + cosine, clipping at 1, zero-initialised new head, optional higher resolution with
position-embedding resampling). Same flags as `vitlab train`."""

from __future__ import annotations

import argparse

from vitlab.commands._load_args import WEIGHTS_HELP
from vitlab.commands.train import add_train_arguments, config_from_args, report, train_or_exit


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("finetune", help="fine-tune weights (any format vitlab.load reads) with the paper's recipe",
                       description=__doc__)
    p.add_argument("--weights", required=False, default=None,
                   help="the weights to start from; " + WEIGHTS_HELP)
    add_train_arguments(p, "finetune")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vitlab.errors import VitlabError

    extra = {"weights": args.weights} if args.weights else {}
    cfg = config_from_args(args, "finetune", extra)
    if not cfg.weights and args.resume:  # a run from scratch, resumed with the wrong command
        raise VitlabError(f"{args.resume} is a run from scratch, not a fine-tuning run; resume it with `vitlab train "
                          f"--resume {args.resume}`")
    if not cfg.weights:
        raise VitlabError("vitlab finetune needs --weights (a run folder, a weights file or folder, or a pretrained "
                          "name such as vit-b/16.augreg-in21k-ft-in1k-224: `vitlab models --pretrained`)")
    return report(train_or_exit(args, cfg))
