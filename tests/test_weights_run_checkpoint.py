"""A training run's checkpoints (RUN/checkpoints/best.pt, step-N.pt) load as weights, with their model's config,
class names and preprocessing; older checkpoints without that record take it from the run's model/ folder."""

import pytest
import torch

import vitlab
from test_train_loop import CLASSES, tiny_cfg, tiny_data
from vitlab.errors import VitlabError
from vitlab.train import train
from vitlab.weights import load_with_meta
from vitlab.weights.run_checkpoint import META_KEY


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train(tiny_cfg(tmp_path_factory.mktemp("runs"), device="cpu"), data=tiny_data()).run_dir


def _same_logits(a, b, channels=1):
    x = torch.randn(3, channels, 8, 8)
    with torch.no_grad():
        return torch.equal(a.eval()(x), b.eval()(x))


def test_best_and_step_checkpoints_load_as_their_weights(run):
    final, final_meta = load_with_meta(run / "model")
    for path in (run / "checkpoints" / "best.pt", *sorted((run / "checkpoints").glob("step-*.pt"))):
        model, meta = load_with_meta(path)
        assert model.config == final.config
        assert meta["class_names"] == CLASSES and meta["preprocess"] == final_meta["preprocess"]
        state = torch.load(path, weights_only=True)["model"]
        for key, value in model.state_dict().items():
            assert torch.equal(value, state[key]), key
    last = sorted((run / "checkpoints").glob("step-*.pt"))[-1]
    assert _same_logits(vitlab.load(last), final)  # the last step is the final model


def test_a_checkpoint_from_before_the_record_borrows_its_runs_model_folder(run, tmp_path):
    state = torch.load(run / "checkpoints" / "best.pt", weights_only=True)
    del state[META_KEY]
    old = run / "checkpoints" / "old.pt"
    torch.save(state, old)
    try:
        model, meta = load_with_meta(old)
        assert meta["class_names"] == CLASSES and _same_logits(model, vitlab.load(run / "checkpoints" / "best.pt"))
    finally:
        old.unlink()
    alone = tmp_path / "best.pt"
    torch.save(state, alone)
    with pytest.raises(VitlabError, match="training checkpoint written before .* load the run's model/ folder"):
        vitlab.load(alone)


def test_a_damaged_record_is_one_line(run, tmp_path):
    state = torch.load(run / "checkpoints" / "best.pt", weights_only=True)
    state[META_KEY]["class_names"] = ["only one"]
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(VitlabError, match="bad.pt lists 1 class names for a model with 3 outputs"):
        vitlab.load(tmp_path / "bad.pt")
