"""One folder-name rule for the studies' model entries: short names as before, long ones unique by a hash."""

from __future__ import annotations

import pytest

from vitlab.errors import VitlabError
from vitlab.experiments import compare
from vitlab.experiments.naming import LIMIT, check_distinct, folder_name

LONG_A = "custom(dim=16,depth=1,heads=2,mlp_dim=32,classifier=token,patch_size=7)"
LONG_B = "custom(dim=16,depth=1,heads=2,mlp_dim=32,classifier=token,patch_size=4)"


def test_short_names_keep_their_old_folders():
    # existing studies resume into these folders: the slugs of short entries must not change
    assert folder_name("vit-b/16") == "vit-b-16"
    assert folder_name("custom(dim=16,depth=1,heads=2,mlp_dim=32,patch_size=7)") == \
        "custom-dim-16-depth-1-heads-2-mlp_dim-32-patch_size-7"
    spec = "resnet-18-small(base_width=8,layers=(1,1))"
    assert folder_name(spec) == "resnet-18-small-base_width-8-layers--1-1"  # the studies' rule
    assert folder_name(spec, collapse=True) == "resnet-18-small-base_width-8-layers-1-1"  # compare's rule
    assert compare._safe(spec) == "resnet-18-small-base_width-8-layers-1-1"
    assert len(folder_name("x" * LIMIT)) == LIMIT and folder_name("x" * LIMIT) == "x" * LIMIT


def test_long_specs_that_differ_at_the_end_get_different_folders():
    for collapse in (False, True):
        a, b = folder_name(LONG_A, collapse=collapse), folder_name(LONG_B, collapse=collapse)
        assert a != b and len(a) <= LIMIT and len(b) <= LIMIT
        assert a.startswith("custom-dim-16-depth-1-heads-2")  # still readable
        assert folder_name(LONG_A, collapse=collapse) == a  # the same entry finds its folder again
    # compare's folders go through the same rule (it overwrote A's folder with B's)
    assert compare._safe(LONG_A) != compare._safe(LONG_B)


def test_names_without_a_usable_slug_are_told_apart():
    assert folder_name("((") != folder_name("))")
    assert folder_name("((").startswith("model-")


def test_entries_that_would_share_a_folder_are_refused():
    check_distinct([LONG_A, LONG_B, "vit"])
    with pytest.raises(VitlabError, match="would share the folder"):
        check_distinct(["vit-b/16", "vit-b-16"])
    with pytest.raises(VitlabError, match="would share the folder"):  # a case-insensitive file system
        check_distinct(["ViT", "vit"])
    check_distinct(["custom(dim=16, depth=1)", "custom(dim=16,depth=1)"])  # '--' kept apart by the studies' rule
    with pytest.raises(VitlabError, match="would share the folder"):
        check_distinct(["custom(dim=16, depth=1)", "custom(dim=16,depth=1)"], collapse=True)
