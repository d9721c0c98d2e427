"""Loading builds the model on the meta device and puts the file's tensors in (`registry.build_unfilled`,
`load_state_dict_strict(..., assign=True)`): no random initialisation first. The loaded model must still be the
saved one to the bit, own its memory, hold its computed tables, and leave torch's random stream alone."""

import pytest
import torch
from torch import nn

import vitlab
from vitlab.errors import VitlabError
from vitlab.models import registry
from vitlab.models.registry import build_unfilled, get_config, model_names
from vitlab.weights import all_finite, load_state_dict_strict, save_hf, save_timm


@pytest.mark.parametrize("name", model_names())
def test_every_named_model_builds_unfilled(name):
    """No named model keeps state a file does not hold: each is built on the meta device, none falls back to the
    full build (which would spend the random initialisation a load does not need)."""
    model = build_unfilled(get_config(name))
    stored = set(model.state_dict())
    assert stored and all(model.state_dict()[k].is_meta for k in stored)
    assert not [k for k, t in model.named_buffers() if k not in stored and t.is_meta]


SMALL = [
    ("custom", {}),
    ("custom", {"posemb": "sincos2d"}),
    ("custom", {"classifier": "gap"}),
    ("custom", {"classifier": "map"}),
    ("custom", {"representation_size": 16}),
    ("custom", {"conv_stem": [8, 16]}),
    ("r+vit-ti/16", {"depth": 1, "image_size": 64}),
    ("resnet-18", {"image_size": 32}),
    ("bit-r26x1", {"image_size": 32}),
    ("bit-r26x1-postact", {"image_size": 32}),
]
VIT = dict(dim=32, depth=2, heads=4, mlp_dim=64, patch_size=4, image_size=16)


def _small(name, kw):
    args = dict(VIT, **kw) if name == "custom" else kw
    model = vitlab.create_model(name, num_classes=3, seed=0, **args).eval()
    with torch.no_grad():  # no zero or constant tensors left, so that every one is compared for real
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model


def _storages(model):
    return [p.untyped_storage().data_ptr() for p in model.parameters()]


@pytest.mark.parametrize("save", ["native", "hf", "timm"])
@pytest.mark.parametrize(("name", "kw"), SMALL, ids=[f"{n}{kw}" for n, kw in SMALL])
def test_load_gives_the_saved_model_to_the_bit(tmp_path, name, kw, save):
    model = _small(name, kw)
    writers = {"native": lambda: vitlab.save(model, tmp_path / "m"), "hf": lambda: save_hf(model, tmp_path / "hf"),
               "timm": lambda: save_timm(model, tmp_path / "m.safetensors")}
    try:
        path = writers[save]()
    except VitlabError as exc:  # the peers' formats do not hold every architecture
        pytest.skip(str(exc))
    before = torch.random.get_rng_state()
    loaded = vitlab.load(path)
    assert torch.equal(torch.random.get_rng_state(), before)  # loading draws no random numbers
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert not any(t.is_meta for t in [*loaded.parameters(), *loaded.buffers()])
    assert all(p.is_contiguous() and p.requires_grad for p in loaded.parameters())
    assert len(set(_storages(loaded))) == len(_storages(loaded))  # each parameter owns its memory
    size = model.config.image_size
    x = torch.randn(2, model.config.in_chans, *((size, size) if isinstance(size, int) else size))
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))


def test_fixed_position_table_is_computed_not_left_empty(tmp_path):
    model = _small("custom", {"posemb": "sincos2d"})
    loaded = vitlab.load(vitlab.save(model, tmp_path / "m"))
    assert "pos_embed" not in loaded.state_dict()  # computed, not stored
    assert torch.equal(loaded.pos_embed, model.pos_embed)
    loaded.set_image_size(32)  # resampling reads the table: a meta one would fail here
    assert loaded.pos_embed.shape[1] == 1 + 8 * 8 and not loaded.pos_embed.is_meta


def test_assigned_tensors_are_copies(tmp_path):
    """The model does not share memory with what the reader returned (a memory-mapped file, a converter's array):
    writing to the state dict afterwards, or rewriting the file, cannot change the model."""
    model = _small("custom", {})
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    target = build_unfilled(model.config)
    load_state_dict_strict(target, sd, assign=True)
    for v in sd.values():
        v.add_(1.0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), target.state_dict().values()))
    folder = vitlab.save(model, tmp_path / "m")
    loaded = vitlab.load(folder)
    other = _small("custom", {})
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    vitlab.save(other, folder)  # the same file, rewritten in place while the loaded model lives
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_transposed_and_float16_sources_load_contiguous_float32():
    model = _small("custom", {})
    sd = model.state_dict()
    odd = {k: (v.t().contiguous().t() if v.ndim == 2 else v).half() for k, v in sd.items()}
    target = build_unfilled(model.config)
    load_state_dict_strict(target, odd, assign=True)
    for k, v in target.state_dict().items():
        assert v.dtype == torch.float32 and v.is_contiguous(), k
        assert torch.equal(v, odd[k].float()), k


class _KeepsUnstoredState(nn.Module):
    """A module with a table it neither stores nor knows how to compute again after a meta build."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.lin = nn.Linear(2, 2)
        self.register_buffer("table", torch.ones(3), persistent=False)


def test_a_model_with_unstored_state_is_built_normally(monkeypatch):
    monkeypatch.setattr(registry, "build_model", _KeepsUnstoredState)
    model = build_unfilled(get_config("vit-ti/16"))
    assert not model.table.is_meta and torch.equal(model.table, torch.ones(3))
    assert not model.lin.weight.is_meta


def test_a_model_that_cannot_be_built_on_meta_is_built_normally(monkeypatch):
    class ReadsAValue(_KeepsUnstoredState):
        def __init__(self, config):
            super().__init__(config)
            self.scale = float(self.lin.weight.detach().abs().sum())  # reads data: impossible on the meta device

    monkeypatch.setattr(registry, "build_model", ReadsAValue)
    model = build_unfilled(get_config("vit-ti/16"))
    assert not model.lin.weight.is_meta and model.scale > 0


def test_all_finite():
    assert all_finite(torch.randn(1000))
    assert all_finite(torch.empty(0))
    for bad in (float("inf"), float("-inf"), float("nan")):
        t = torch.randn(1000)
        t[517] = bad
        assert not all_finite(t)
    both = torch.zeros(10)
    both[1], both[2] = float("inf"), float("-inf")  # their sum is NaN: still caught
    assert not all_finite(both)
    huge = torch.full((8,), 3e38)  # finite values whose sum overflows: the exact test decides
    assert all_finite(huge) and all_finite(torch.full((64,), 60000.0).half())


def test_regularisation_rebuild_copies_the_given_model():
    """`--drop-path` on a given or loaded model rebuilds it without initialising (train/setup.py): the same
    weights, the new rate, and the caller's model untouched by training the rebuilt one."""
    from types import SimpleNamespace

    from vitlab.train.setup import with_regularisation

    model = _small("custom", {})
    before = torch.random.get_rng_state()
    rebuilt = with_regularisation(model, SimpleNamespace(dropout=None, drop_path=0.1))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert rebuilt is not model and rebuilt.config.drop_path == 0.1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), rebuilt.state_dict().values()))
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in rebuilt.parameters():
            p.add_(1.0)
    assert all(torch.equal(v, kept[k]) for k, v in model.state_dict().items())
