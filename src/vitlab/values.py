"""Typed values from text, YAML and flags, shared by training, evaluation and the commands.

PyYAML reads YAML 1.1, where `3e-4` is a string and `yes` a bool: every setting a user writes goes through
`convert(hint, value)` to the type its dataclass declares, and `parse_kv` reads `key=value,...` flags.
This module sits below `train/` and `evaluate/` so that neither reaches into the other for it.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any

import yaml

from vitlab.errors import VitlabError

TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")
NULL_WORDS = ("none", "null", "~", "")


class NotOfType(Exception):
    """A value that does not fit a type; callers turn it into a one-line VitlabError naming the setting."""


def as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # `hflip: 1` in YAML, as `--set hflip=1`
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise NotOfType


def as_float(value: Any) -> float:
    # PyYAML reads YAML 1.1, where 3e-4 (no dot) is a string: parse numbers from text ourselves
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise NotOfType
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except ValueError:
        raise NotOfType from None
    if not math.isfinite(number):  # NaN passes every `<` check and then poisons the run
        raise NotOfType
    return number


def as_int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    number = as_float(value)  # 1e3 or 128.0: whole numbers written as floats
    if not number.is_integer():
        raise NotOfType
    return int(number)


def as_str(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise NotOfType  # a YAML `yes` or a list where a name belongs is a mistake, not a name
    return str(value)


def as_sequence(value: Any) -> list:
    """A list from YAML, a tuple, or text such as '0.9,0.95', '(0.9, 0.95)' or '[2, 9]'."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, str):
        text = value.strip().strip("()[]")
        return [part.strip() for part in text.split(",")] if text else []
    raise NotOfType


def as_tuple(hint: Any, value: Any) -> tuple:
    element_types = typing.get_args(hint)
    items = as_sequence(value)
    if len(items) != len(element_types):
        raise NotOfType
    return tuple(convert(t, v) for t, v in zip(element_types, items))


def as_per_channel(value: Any) -> float | list[float]:
    """One number for every channel, or a list of one number per channel."""
    if isinstance(value, str) and "," in value:
        value = as_sequence(value)
    if isinstance(value, (list, tuple)):
        if not value:
            raise NotOfType
        return [as_float(v) for v in value]
    return as_float(value)


def is_null(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in NULL_WORDS)


def convert(hint: Any, value: Any) -> Any:
    """`value` as type `hint` (bool, int, float, str, tuple[...], X | None, Any); NotOfType when it cannot be."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = typing.get_args(hint)
        if type(None) in members and is_null(value):
            return None
        for member in (t for t in members if t is not type(None)):  # the first type that fits, in declared order
            try:
                return convert(member, value)
            except NotOfType:
                pass
        raise NotOfType
    if value is None:
        raise NotOfType
    if typing.get_origin(hint) is tuple:
        return as_tuple(hint, value)
    converters = {bool: as_bool, int: as_int, float: as_float, str: as_str}
    if hint in converters:
        return converters[hint](value)
    return value  # Any, dict: checked by their users


def describe(hint: Any) -> str:
    """The expected type in words, for error messages."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = typing.get_args(hint)
        words = " or ".join(describe(t) for t in members if t is not type(None))
        return f"{words}, or null" if type(None) in members else words
    if typing.get_origin(hint) is tuple:
        kinds = {t for t in typing.get_args(hint)}
        word = "whole numbers" if kinds == {int} else "numbers"
        return f"{len(typing.get_args(hint))} {word} separated by commas (e.g. {'2,9' if kinds == {int} else '0.9,0.999'})"
    return {bool: "true or false", int: "a whole number (e.g. 128)", float: "a finite number (e.g. 0.5, 3 or 3e-4)",
            str: "a text value"}.get(hint, "a value")


def shown(value: Any) -> str:
    return "null" if value is None else repr(value)


def typed_model_args(args: dict[str, Any], source: str = "from the model arguments") -> dict[str, Any]:
    """Model arguments with the values whose type the model config declares coerced to it
    (`layer_norm_eps=1e-6` is a string to YAML 1.1); unknown keys are left to the model registry."""
    from vitlab.models.config import ResNetConfig, ViTConfig, canonical_fields

    vit_types, resnet_types = typing.get_type_hints(ViTConfig), typing.get_type_hints(ResNetConfig)
    # other libraries' names (embed_dim, img_size) as vitlab's, so that they merge with a preset's and are typed
    return _typed_args(canonical_fields(args), {**resnet_types, **vit_types}, resnet_types, source)


def _is_scalar_type(hint: Any) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return all(_is_scalar_type(t) for t in typing.get_args(hint) if t is not type(None))
    return hint in (bool, int, float)


def _typed_args(args: dict[str, Any], known: dict[str, Any], resnet_types: dict[str, Any], source: str) -> dict:
    out = {}
    for key, value in args.items():
        hint = known.get(key)
        if key == "resnet" and isinstance(value, dict):  # nested ResNet settings (resnet.stem=bit)
            out[key] = _typed_args(value, resnet_types, resnet_types, source)
        elif hint is not None and _is_scalar_type(hint):  # numbers and switches; names and lists stay as given
            try:
                out[key] = convert(hint, value)
            except NotOfType:
                raise VitlabError(f"model argument {key} must be {describe(hint)}, got {shown(value)} "
                                  f"({source})") from None
        else:
            out[key] = value
    return out


def split_outside_brackets(text: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside brackets: "a=1,b=[1,2],c=(3,4)" -> ["a=1", "b=[1,2]", "c=(3,4)"]."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == sep and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return out


def parse_kv(text: str) -> dict[str, Any]:
    """'dim=64,depth=6,conv_stem=[32,64]' -> {'dim': 64, 'depth': 6, 'conv_stem': [32, 64]} (values as YAML).

    Dotted keys reach into nested settings: 'resnet.stem=bit' -> {'resnet': {'stem': 'bit'}}.
    """
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in split_outside_brackets(str(text)))):
        if "=" not in part:
            raise VitlabError(f"expected key=value, got {part!r} (e.g. dim=64,depth=6)")
        k, v = part.split("=", 1)
        *parents, leaf = k.strip().replace("-", "_").split(".")
        node = out
        for name in parents:
            node = node.setdefault(name, {})
        try:
            node[leaf] = yaml.safe_load(v)
        except yaml.YAMLError:
            raise VitlabError(f"cannot read the value of {k.strip()!r}: {v!r} (lists are written [32,64])") from None
    return out


def yaml_problem(exc: yaml.YAMLError) -> str:
    """'line 3: expected ',' or ']', but got '<stream end>'' rather than PyYAML's multi-line report."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"line {mark.line + 1}: {problem}" if mark is not None else problem
