"""A run records the test split it left out: `test_fraction` and the split's seed (`data_seed`, None: `seed`).

The studies split the data with their own settings: `vitlab compare --test-fraction 0.05` and `vitlab study scaling`
(seed 0 for the split, seeds 1, 2, ... for the runs' initialisation). A run's config.yaml held neither, so `vitlab
evaluate RUN` redrew the split with test fraction 0.1 and the run's own seed and tested on images the run had
trained on."""

from vitlab.data import load_data
from vitlab.evaluate.loading import run_data_settings
from vitlab.experiments.compare import OWNED_KEYS
from vitlab.experiments.scaling import ScalingSettings, _train_overrides
from vitlab.train import resolve_config, train

TINY = dict(data="digits", model="custom", model_args={"dim": 16, "depth": 1, "heads": 2, "mlp_dim": 32,
            "patch_size": 4}, steps=1, batch_size=8, precision="fp32", threads=1, device="cpu", quiet=True)


def test_evaluate_redraws_the_test_split_a_run_left_out(tmp_path):
    cfg = resolve_config("small-data", overrides={**TINY, "out_dir": str(tmp_path), "name": "r", "seed": 1,
                                                  "data_seed": 5, "test_fraction": 0.3})
    run = train(cfg).run_dir
    held_out = load_data("digits", test_fraction=0.3, seed=5, progress=False).test
    settings = run_data_settings(run)
    redrawn = load_data(settings.pop("data"), progress=False, **settings).test
    assert len(redrawn) == len(held_out)
    assert bool((redrawn.images == held_out.images).all())


def test_the_studies_record_their_split_in_each_run(tmp_path):
    st = ScalingSettings(data="digits", seed=0)
    overrides = _train_overrides("vit", 100, 2, st, tmp_path / "run", steps_per_epoch=10)
    assert (overrides["seed"], overrides["data_seed"]) == (2, 0)  # initialisation varies, the split does not
    assert OWNED_KEYS["data_seed"] == "--seed" and OWNED_KEYS["test_fraction"] == "--test-fraction"


def test_fractions_that_leave_no_training_images_are_said_with_their_flags():
    import pytest

    from vitlab.errors import VitlabError

    with pytest.raises(VitlabError, match="--val-fraction 0.95 and --test-fraction 0.1 leave no training images"):
        load_data("digits", val_fraction=0.95, test_fraction=0.1, progress=False)
