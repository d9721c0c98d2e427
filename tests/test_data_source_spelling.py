"""One spelling per data folder: `vitlab evaluate RUN --data /data/shapes/` (tab completion's trailing slash) was
not the run's own '/data/shapes', so the evaluation drew other splits and tested on the run's training images."""

from vitlab.commands.evaluate import _same_source
from vitlab.data.load import absolute_source


def test_trailing_slash_and_dot_name_the_same_folder(tmp_path):
    folder = tmp_path / "shapes"
    folder.mkdir()
    for spelling in (f"{folder}/", f"{folder}/.", f"{folder}//", str(folder)):
        assert absolute_source(spelling) == str(folder)
        assert _same_source(spelling, str(folder))
    assert absolute_source(f"hf:{folder}/") == f"hf:{folder}"
    assert not _same_source(f"{folder}/other", str(folder))
    assert absolute_source("fashion-mnist") == "fashion-mnist"  # names stay as given
