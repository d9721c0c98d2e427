"""Layout of the inspection figures: the figure title never covers an axes' title or labels."""

import numpy as np
import pytest

from vitlab.inspect import figures


@pytest.mark.parametrize("layers,heads", [(1, 1), (2, 2), (3, 4), (6, 3), (12, 12), (24, 16)])
def test_attention_maps_title_clears_the_input_title_and_labels(layers, heads, tmp_path, monkeypatch):
    """Measured: with 2 layers the suptitle sat on the "input" title (fixed subplot margins)."""
    drawn = []

    def keep(fig, path):  # draw the figure as savefig would and keep it for measuring
        fig.canvas.draw()
        drawn.append(fig)
        return path

    monkeypatch.setattr(figures, "_save", keep)
    rng = np.random.default_rng(0)
    figures.plot_attention_maps(rng.random((layers, heads, 4, 4)), tmp_path / "a.png", image=rng.random((28, 28, 1)),
                                title="Raw attention of image 1 per layer and head (class-token row)")
    fig = drawn[0]
    renderer = fig.canvas.get_renderer()
    top = fig._suptitle.get_window_extent(renderer)
    for ax in fig.axes:
        box = ax.get_tightbbox(renderer)  # the axes with its title, tick labels and axis labels
        assert not top.overlaps(box), (ax.get_title(), top, box)
