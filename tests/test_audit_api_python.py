"""Audit of the Python surface as a timm / Hugging Face user meets it: `vitlab.list_models("vit*")` like
timm.list_models, typed and documented top-level functions, and a namespace without importlib's names."""

import inspect

import vitlab


def test_list_models_without_filter_is_every_registered_model():
    assert vitlab.list_models() == vitlab.model_names()


def test_list_models_filters_with_wildcards_like_timm():
    assert vitlab.list_models("vit-b*") == ["vit-b/8", "vit-b/14", "vit-b/16", "vit-b/32", "vit-b/16-gap"]
    assert vitlab.list_models("VIT-B/16") == ["vit-b/16"]  # case does not matter
    assert vitlab.list_models(["resnet-5*", "*r152*"]) == ["resnet-50", "bit-r152x2", "bit-r152x4",
                                                           "bit-r152x1-postact"]
    assert vitlab.list_models("no-such-*") == []


def test_list_models_pretrained_names_the_checkpoints():
    from vitlab.weights.pretrained import PRETRAINED

    assert vitlab.list_models(pretrained=True) == list(PRETRAINED)
    found = vitlab.list_models("vit-s/16*", pretrained=True)
    assert found and all(n.startswith("vit-s/16.") for n in found)
    # every name it gives is one create_model / vitlab.load take
    assert all(vitlab.models.registry.normalize_name(n.split(".")[0]) == n.split(".")[0] for n in found)


def test_list_models_is_public_and_documented():
    assert "list_models" in vitlab.__all__ and "list_models" in dir(vitlab)
    assert "vit*" in (vitlab.list_models.__doc__ or "")


def test_top_level_functions_are_typed_and_documented():
    for name in ("load", "save", "list_models"):
        fn = getattr(vitlab, name)
        sig = inspect.signature(fn)
        untyped = [p.name for p in sig.parameters.values()
                   if p.annotation is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD]
        assert not untyped, f"vitlab.{name}: parameters without a type: {untyped}"
        assert sig.return_annotation is not inspect.Signature.empty, f"vitlab.{name}: no return type"
        assert fn.__doc__ and len(fn.__doc__.strip().splitlines()) >= 2, f"vitlab.{name}: a one-line docstring"


def test_load_names_the_options_it_passes_on():
    params = inspect.signature(vitlab.load).parameters
    assert "keep_representation" in params  # vitlab.weights.load's, shown in help(vitlab.load)


def test_namespace_holds_no_importlib_names():
    # `vitlab.version` was importlib.metadata.version, which reads like vitlab's own version function
    assert not hasattr(vitlab, "version")
    assert not hasattr(vitlab, "PackageNotFoundError")
    assert isinstance(vitlab.__version__, str)
