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

A class map is given inline, as a JSON or text file, or by the name of a bundled example
(`fashion-mnist-footwear-in1k`, `fashion-mnist-footwear-in21k` for BiT-M's 21k heads).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn

from vitlab.errors import VitlabError

LABEL_FRESH = "zero-shot (fresh head, chance)"
LABEL_MAPPED_IMAGENET = "zero-shot (mapped ImageNet head)"
LABEL_MAPPED = "zero-shot (mapped pretrained head)"
LABEL_FINETUNED = "fine-tuned"
LABEL_TRAINED = "trained head"
# a head taken as the data's because its size is the number of classes (a state dict stores no names): a guess
LABEL_BY_COUNT = " (by class count: the weights name no classes)"
LABEL_UNTRAINED = "untrained model (random init, chance)"


LABEL_MAPPED_IMAGENET21K = "zero-shot (mapped ImageNet-21k head)"

# Example maps shipped with the package (vitlab/data/bundled/maps/<name>.txt), usable by name.
MAPS_PACKAGE = ("vitlab.data", "bundled", "maps")


def mapped_label(head_classes: int) -> str:
    if head_classes == 21843:
        return LABEL_MAPPED_IMAGENET21K
    return LABEL_MAPPED_IMAGENET if head_classes == 1000 else LABEL_MAPPED


def bundled_maps() -> dict[str, str]:
    """{name: text} of the example class maps shipped with vitlab."""
    from importlib import resources

    folder = resources.files(MAPS_PACKAGE[0]).joinpath(*MAPS_PACKAGE[1:])
    if not folder.is_dir():
        return {}
    return {f.name.removesuffix(".txt").removesuffix(".json"): f.read_text()
            for f in folder.iterdir() if f.name.endswith((".txt", ".json"))}


def read_class_map(spec: str) -> tuple[list[tuple[str, list[str]]], str]:
    """([(data class, [head class, ...]), ...], where it came from) from any --zero-shot-map form.

    Forms: inline 'Sandal=774,Sneaker=770+630'; a file (JSON {"Sandal": [774], ...} or one
    'Sandal = 774' per line, '#' comments); or the name of a bundled map (`bundled_maps()`).
    Head classes stay strings here: indices or the head's label names, resolved by `parse_class_map`.
    """
    spec = str(spec).strip()
    bundled = bundled_maps()
    path = Path(spec).expanduser()
    if spec in bundled:
        return _parse_map_text(bundled[spec], f"bundled map {spec}", lines=True), f"bundled map {spec}"
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise VitlabError(f"cannot read the class map {path}: {exc}") from None
        if path.suffix.lower() == ".json" or text.lstrip().startswith("{"):
            return _parse_map_json(text, path), f"file {path}"
        return _parse_map_text(text, f"class map {path}", lines=True), f"file {path}"
    if "=" not in spec and (path.suffix.lower() in (".json", ".txt", ".map") or "/" in spec):
        raise VitlabError(f"class map file {spec} not found; give an existing file, an inline map like "
                          f"'Sandal=774,Sneaker=770+630', or a bundled map: {sorted(bundled)}")
    return _parse_map_text(spec, "--zero-shot-map", lines=False), "inline"


def _parse_map_text(text: str, where: str, lines: bool) -> list[tuple[str, list[str]]]:
    """'name=idx+idx' items: one per line in a file (so head label names may hold commas), comma-separated inline."""
    items = text.splitlines() if lines else text.split(",")
    out = []
    for item in items:
        item = item.split("#", 1)[0].strip() if lines else item.strip()
        if not item:
            continue
        if "=" not in item:
            raise VitlabError(f"bad entry {item!r} in {where}; write CLASS=INDEX[+INDEX...], e.g. 'Sandal=774'")
        key, _, value = item.rpartition("=")
        out.append((key.strip(), [v.strip() for v in value.split("+")]))
    return out


def _parse_map_json(text: str, path: Path) -> list[tuple[str, list[str]]]:
    import json

    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise VitlabError(f"the class map {path} is not valid JSON ({exc}); write {{\"Sandal\": [774], ...}}") from None
    if not isinstance(data, dict):
        raise VitlabError(f"the class map {path} must be a JSON object like {{\"Sandal\": [774], \"Sneaker\": [770, 630]}}")
    out = []
    for key, value in data.items():
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in values):
            raise VitlabError(f"the class map {path} maps {key!r} to {value!r}; give a head index, a head label "
                              "name or a list of them")
        out.append((str(key), [str(v).strip() for v in values]))
    return out


def _head_index(target: str, key: str, head_classes: int | None, head_names: Sequence[str] | None) -> int:
    """A head class given as an index or (when the model's class names are known) as a label name. A name matches
    a whole label first, else one of a label's comma-separated synonyms ('clog, geta, patten, sabot'); a name that
    matches several head classes the same way (ImageNet has two 'crane's) is refused: only an index says which."""
    if _is_number(target):
        t = int(target)
        if head_classes is not None and t >= head_classes:
            raise VitlabError(f"--zero-shot-map index {t} is outside the pretrained head's 0..{head_classes - 1}")
        return t
    if not head_names:
        raise VitlabError(f"--zero-shot-map maps {key!r} to the label {target!r}, but this model's head has no "
                          "class names stored; give head indices instead (e.g. 770 for 'running shoe')")
    want = target.lower()
    labels = [str(name).lower() for name in head_names]
    whole = [i for i, label in enumerate(labels) if label == want]
    synonym = [i for i, label in enumerate(labels) if want in (part.strip() for part in label.split(","))]
    found = whole or synonym
    if len(found) > 1:
        which = ", ".join(f"{i} ({head_names[i]!r})" for i in found[:6])
        raise VitlabError(f"--zero-shot-map target {target!r} (for {key!r}) matches {len(found)} classes of the "
                          f"pretrained head: {which}; give the index of the one you mean")
    if found:
        return found[0]
    raise VitlabError(f"--zero-shot-map target {target!r} (for {key!r}) is neither an index nor a class of the "
                      "pretrained head; check the spelling or give the index")


def parse_class_map(
    spec: str,
    class_names: Sequence[str],
    head_classes: int | None = None,
    head_names: Sequence[str] | None = None,
) -> list[list[int]]:
    """Any --zero-shot-map form (see `read_class_map`) -> [[774], [770, 630], [514]] in data-class order.

    Keys are class names of the data set or their indices; every data class must be mapped. Targets are
    head indices, or the head's label names when `head_names` (the model's class names) are known.
    """
    names = [str(n) for n in class_names]
    mapping: dict[int, list[int]] = {}
    for cls, key, targets in _keyed_entries(spec, names):
        if not all(targets):
            raise VitlabError(f"bad --zero-shot-map target list for {key!r}; give head indices like 770+630")
        mapping[cls] = [_head_index(t, key, head_classes, head_names) for t in targets]
    check_every_class_mapped(mapping, names)
    check_head_classes_used_once(mapping, names)
    return [mapping[i] for i in range(len(names))]


def check_head_classes_used_once(mapping: dict[int, list], names: list[str]) -> None:
    """Refuse a head class given to two data classes, or twice to one. Its probability would count for both (with
    one head class each, the two always tie and argmax never predicts the later one), or twice for one class."""
    owner: dict = {}
    for cls in sorted(mapping):
        for target in mapping[cls]:
            if target in owner:
                first = names[owner[target]]
                where = f"twice for {first!r}" if owner[target] == cls else f"for both {first!r} and {names[cls]!r}"
                raise VitlabError(f"--zero-shot-map gives head class {target} {where}: its probability would count "
                                  "twice; give each head class to one data class, once")
            owner[target] = cls


def _keyed_entries(spec: str, names: list[str]) -> list[tuple[int, str, list[str]]]:
    """(data class, key as written, targets) per line of the map; a class named twice is refused (a second line
    would silently replace the first)."""
    out, seen = [], {}
    for key, targets in read_class_map(spec)[0]:
        cls = _data_class(key, names)
        if cls in seen:
            raise VitlabError(f"--zero-shot-map maps class {names[cls]!r} twice ({seen[cls]!r} and {key!r}); give "
                              "each class one entry, with its head classes joined by '+'")
        seen[cls] = key
        out.append((cls, key, targets))
    return out


def check_map_fits_data(spec: str, class_names: Sequence[str]) -> None:
    """What of a map the data alone can judge (its keys name the data's classes, every class is mapped): for
    `vitlab compare`, before any model is loaded, also where no model's head ends up using the map."""
    names = [str(n) for n in class_names]
    entries = _keyed_entries(spec, names)
    check_every_class_mapped({cls: [] for cls, _, _ in entries}, names)
    # head indices can be checked without the model (label names only once its class names are known)
    check_head_classes_used_once({cls: [int(t) for t in targets if _is_number(t)] for cls, _, targets in entries},
                                 names)


def _data_class(key: str, names: list[str]) -> int:
    """The data class a map key names: a class name (any case) or its index."""
    lowered = {n.lower(): i for i, n in enumerate(names)}
    if key.lower() in lowered:
        return lowered[key.lower()]
    if _is_number(key) and int(key) < len(names):
        return int(key)
    raise VitlabError(f"--zero-shot-map names class {key!r}, which the data set does not have; its classes: {names}")


def _is_number(text: str) -> bool:
    """0-9 only: str.isdigit() also takes '²' and other digits that int() refuses."""
    return text.isascii() and text.isdigit()


def check_every_class_mapped(mapping: dict[int, list[int]], names: list[str]) -> None:
    missing = [names[i] for i in range(len(names)) if i not in mapping]
    if missing:
        raise VitlabError(f"--zero-shot-map leaves classes {missing} unmapped; map every class of the data set")


def mapped_scores(logits: torch.Tensor, class_map: Sequence[Sequence[int]]) -> torch.Tensor:
    """(B, K_new) scores: summed pretrained probabilities of each new class's head classes (float64).

    float64 because in float32 a probability underflows to 0 once its logit is ~104 below the head's largest: a
    test image the head gives to an unmapped class that confidently tied every data class at 0, and argmax said
    class 0 whatever the restricted logits said (float64 holds to a gap of ~745)."""
    probs = logits.double().softmax(dim=-1)
    return torch.stack([probs[:, list(idx)].sum(dim=1) for idx in class_map], dim=1)


def with_fresh_head(model: nn.Module, num_classes: int, seed: int = 0) -> nn.Module:
    """A copy of `model` whose classifier is a new randomly initialised nn.Linear (PyTorch default init); the
    representation layer, if any, is kept, so the copy's pre-logits features are the model's."""
    fresh = copy.deepcopy(model)
    # Only the final Linear is new: the representation layer (pre-logits) is the backbone's. Dropping it (the
    # fine-tuning surgery's default) gave this copy other features than the model's, and the frozen-feature
    # evaluations, which take their test features from this pass, compared them with the model's training features.
    fresh.reset_classifier(num_classes, keep_representation=True)
    head = getattr(fresh, "head", None)
    if not isinstance(head, nn.Linear):
        raise VitlabError("this model has no linear `head` to replace; zero-shot with a fresh head needs one")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head.reset_parameters()
    return fresh
