"""`vitlab models` prints a committed table (it starts without torch); the table must equal what the
built models say, so a changed model or a new name fails here until the table is regenerated."""

import vitlab.commands.models as models_command


def test_committed_table_matches_the_built_models():
    built = models_command.rows_built(224, 1000)
    table = models_command.rows(224, 1000)
    assert [r["name"] for r in table] == [r["name"] for r in built]
    for got, want in zip(table, built):
        assert got == want, (
            f"{want['name']}: commands/models.py TABLE says {got}, the built model {want}; regenerate TABLE "
            "from models_command.rows_built()")


def test_other_sizes_are_computed_from_the_models():
    rows = {r["name"]: r for r in models_command.rows(448, 10)}
    default = {r["name"]: r for r in models_command.rows()}
    # B/16 at 448: 784 + 1 position slots instead of 197; 10 classes instead of 1000
    assert rows["vit-b/16"]["params"] == default["vit-b/16"]["params"] + 588 * 768 - 990 * 769
    assert rows["vit-b/16"]["macs"] > 3 * default["vit-b/16"]["macs"]


def test_pretrained_table_lists_every_checkpoint(capsys):
    from vitlab.cli import main
    from vitlab.weights.pretrained import PRETRAINED

    assert main(["models", "--pretrained", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "name,model,resolution,labels,size,integrity,licence,source"
    assert [line.split(",")[0] for line in lines[1:]] == list(PRETRAINED)
    assert ("vit-b/16.orig-in21k,vit-b/16,224,imagenet21k,-,unverified,Apache-2.0,"
            "https://storage.googleapis.com/vit_models/imagenet21k/ViT-B_16.npz") in lines


def test_a_size_some_strides_do_not_divide_lists_the_others_and_names_those(capsys):
    """`vitlab models --image-size 384` (the paper's fine-tuning size) failed on the patch-14 models."""
    from vitlab.cli import main as cli

    assert cli(["models", "--image-size", "384"]) == 0
    out, err = capsys.readouterr()
    assert "vit-b/16" in out and "vit-b/14" not in out
    assert "left out vit-ti/14" in err and "not a multiple of their stride" in err
