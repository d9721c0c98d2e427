"""Zero-shot evaluation of a pretrained classifier on new classes, without any training.

Two honest variants, labelled differently in every table:
- mapped head: each new class is mapped to one or more classes of the pretrained head (e.g.
  "Sandal=774,Sneaker=770+630,Ankle boot=514" for ImageNet-1k); the score of a new class is the
  sum of the pretrained softmax probabilities of its classes (for one class each this is the
  argmax over the restricted logits). This is real zero-shot transfer.
- fresh head: the pretrained backbone with a new, untrained head (PyTorch's default random
  nn.Linear init, seeded), as the comparison studies did. Expected at chance level: it measures
  nothing but the head's initialisation. (A zero-initialised head, as the paper fine-tunes from,
  would output all-equal logits and always predict class 0.)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn as nn

from vitlab.errors import VitlabError

LABEL_FRESH = "zero-shot (fresh head, chance)"
LABEL_MAPPED_IMAGENET = "zero-shot (mapped ImageNet head)"
LABEL_MAPPED = "zero-shot (mapped pretrained head)"
LABEL_FINETUNED = "fine-tuned"
LABEL_TRAINED = "trained head"
LABEL_UNTRAINED = "untrained model (random init, chance)"


def mapped_label(head_classes: int) -> str:
    return LABEL_MAPPED_IMAGENET if head_classes in (1000, 21843) else LABEL_MAPPED


def parse_class_map(spec: str, class_names: Sequence[str], head_classes: int | None = None) -> list[list[int]]:
    """"Sandal=774,Sneaker=770+630,Ankle boot=514" -> [[774], [770, 630], [514]] in data-class order.

    Keys are class names of the data set or their indices; every data class must be mapped.
    """
    names = [str(n) for n in class_names]
    lowered = {n.lower(): i for i, n in enumerate(names)}
    mapping: dict[int, list[int]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if "=" not in item:
            raise VitlabError(f"bad --zero-shot-map entry {item!r}; write CLASS=INDEX[+INDEX...], e.g. 'Sandal=774'")
        key, _, value = item.rpartition("=")
        key = key.strip()
        if key.lower() in lowered:
            cls = lowered[key.lower()]
        elif key.isdigit() and int(key) < len(names):
            cls = int(key)
        else:
            raise VitlabError(f"--zero-shot-map names class {key!r}, which the data set does not have; its classes: {names}")
        try:
            targets = [int(v) for v in value.split("+")]
        except ValueError:
            raise VitlabError(f"bad --zero-shot-map target {value!r} for {key!r}; give head indices like 770+630") from None
        for t in targets:
            if t < 0 or (head_classes is not None and t >= head_classes):
                raise VitlabError(f"--zero-shot-map index {t} is outside the pretrained head's 0..{(head_classes or 1) - 1}")
        mapping[cls] = targets
    missing = [names[i] for i in range(len(names)) if i not in mapping]
    if missing:
        raise VitlabError(f"--zero-shot-map leaves classes {missing} unmapped; map every class of the data set")
    return [mapping[i] for i in range(len(names))]


def mapped_scores(logits: torch.Tensor, class_map: Sequence[Sequence[int]]) -> torch.Tensor:
    """(B, K_new) scores: summed pretrained probabilities of each new class's head classes."""
    probs = logits.float().softmax(dim=-1)
    return torch.stack([probs[:, list(idx)].sum(dim=1) for idx in class_map], dim=1)


def with_fresh_head(model: nn.Module, num_classes: int, seed: int = 0) -> nn.Module:
    """A copy of `model` whose classifier is a new randomly initialised nn.Linear (PyTorch default init)."""
    fresh = copy.deepcopy(model)
    fresh.reset_classifier(num_classes)
    head = getattr(fresh, "head", None)
    if not isinstance(head, nn.Linear):
        raise VitlabError("this model has no linear `head` to replace; zero-shot with a fresh head needs one")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head.reset_parameters()
    return fresh
