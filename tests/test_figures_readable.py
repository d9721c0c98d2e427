"""Figures people can read: rollout titles of at least 9 pt that do not collide, legends of the comparison
curves outside the data, and position-embedding similarity scaled to the figure (a sin-cos table is not
one flat colour)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from vitlab.evaluate import plots  # noqa: E402
from vitlab.inspect import figures, posemb_similarity  # noqa: E402
from vitlab.inspect.posemb import similarity_limits  # noqa: E402
from vitlab.models.registry import create_model  # noqa: E402


@pytest.fixture
def kept(monkeypatch):
    """Keep every saved figure open (the modules close them after saving) and return the list."""
    saved = []
    for module in (figures, plots):
        real = module._save

        def keep(fig, path, real=real):
            saved.append(fig)
            fig.savefig(path, dpi=110, bbox_inches="tight")
            return path
        monkeypatch.setattr(module, "_save", keep)
    yield saved
    for fig in saved:
        plt.close(fig)


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("k", [1, 3, 8, 16])
def test_rollout_titles_are_9pt_and_do_not_collide(kept, tmp_path, k):
    rng = np.random.default_rng(0)
    labels = [f"{'Ankle boot' if i % 2 else 'T-shirt/top'}\npred: {'Sneaker' if i % 3 else 'Pullover'}" for i in range(k)]
    figures.plot_rollout(rng.random((k, 28, 28, 1)), rng.random((k, 4, 4)), tmp_path / "r.png", labels=labels)
    fig = kept[-1]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    titles = [ax.title for ax in fig.axes if ax.get_title()]
    assert len(titles) == k
    assert min(t.get_fontsize() for t in titles) >= 9
    boxes = [t.get_window_extent(renderer) for t in titles]
    assert not any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    for t, box in zip(titles, boxes):  # each title sits above its own image, not over it
        img = t.axes.get_window_extent(renderer)
        assert box.y0 >= img.y1 - 1
    from PIL import Image

    assert Image.open(tmp_path / "r.png").width <= 1100  # the report (1100 px wide) shows it unscaled, still 9 pt


def _assert_legend_outside_data(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    legend = ax.get_legend()
    assert legend is not None
    assert not _overlap(legend.get_window_extent(renderer), ax.get_window_extent(renderer))


def test_compare_curve_legends_do_not_cover_the_data(kept, tmp_path):
    # real-looking curves that run into the upper right corner (where "best" used to land)
    epochs = list(range(10))
    series = {name: (epochs, [40 + (50 - i) * (1 - np.exp(-e / 2)) for e in epochs])
              for i, name in enumerate(["vit-ti/16 (in21k)", "hybrid r26+vit-ti/16", "resnet-50 (bit)"])}
    plots.plot_lines(series, tmp_path / "val_accuracy.png", "validation accuracy", ylabel="accuracy (%)")
    _assert_legend_outside_data(kept[-1])
    curves = {"a": ([1, 5, 10], [0.3, 0.6, 0.7], [0.02, 0.02, 0.01]), "b": ([1, 5, 10], [0.4, 0.7, 0.9], [0, 0, 0])}
    plots.plot_fewshot(curves, tmp_path / "fewshot.png", chance=0.1)
    _assert_legend_outside_data(kept[-1])


def _clim(fig):
    return fig.axes[0].get_images()[0].get_clim()


def test_sincos_posemb_is_scaled_to_its_own_range(kept, tmp_path):
    model = create_model("custom", dim=64, depth=1, heads=2, mlp_dim=64, patch_size=7, image_size=28, in_chans=1,
                         num_classes=3, posemb="sincos2d", classifier="gap", seed=0)
    sim = posemb_similarity(model.pos_embed, model.config.grid_size, model.num_prefix_tokens)
    off = sim.reshape(16, 16)[~np.eye(16, dtype=bool)]
    assert off.min() > 0.5  # why -1..1 looked flat: every similarity of the table is high
    figures.plot_posemb_similarity(sim, tmp_path / "p.png")
    lo, hi = _clim(kept[-1])
    assert (lo, hi) != (-1.0, 1.0) and lo > 0.5 and hi < 1.0
    assert (lo, hi) == pytest.approx(tuple(np.percentile(off, [1, 99])))
    assert "scale" in kept[-1].axes[1].get_ylabel()  # the colour bar says which scale it shows


def test_paper_scale_is_available(kept, tmp_path):
    sim = posemb_similarity(torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(1)), (2, 2), 1)
    figures.plot_posemb_similarity(sim, tmp_path / "p.png", scale="paper")
    assert _clim(kept[-1]) == (-1.0, 1.0)


def test_learned_posemb_uses_the_same_robust_scale(kept, tmp_path):
    e = torch.randn(1, 1 + 25, 32, generator=torch.Generator().manual_seed(0))
    sim = posemb_similarity(e, (5, 5), 1)
    figures.plot_posemb_similarity(sim, tmp_path / "p.png")
    lo, hi = _clim(kept[-1])
    assert (lo, hi) == pytest.approx(similarity_limits(sim))
    assert -1.0 < lo < 0.0 < hi < 1.0


def test_constant_similarity_gets_a_band_not_an_error():
    sim = np.ones((2, 2, 2, 2))
    lo, hi = similarity_limits(sim)
    assert lo < 1.0 <= hi


@pytest.mark.parametrize("grid", [(3, 9), (9, 3), (5, 5)])
def test_similarity_colour_bar_is_as_tall_as_the_grid(kept, tmp_path, grid):
    """On a wide grid (a 224 x 672 input) the colour bar ran the axes' full height, far above and below the tiles."""
    h, w = grid
    e = torch.randn(1, 1 + h * w, 16, generator=torch.Generator().manual_seed(0))
    figures.plot_posemb_similarity(posemb_similarity(e, grid, 1), tmp_path / "p.png")
    fig = kept[-1]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    tiles = fig.axes[0].get_images()[0].get_window_extent(renderer)  # pixels, where the tiles are drawn
    bar = fig.axes[1].get_window_extent(renderer)
    # the bar's scale (without its extension triangles, up to 5 % of its length at each end) within the tiles' rows
    assert tiles.y0 - 1 <= bar.y0 and bar.y1 <= tiles.y1 + 1
    assert bar.height >= 0.85 * tiles.height
