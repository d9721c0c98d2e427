"""One spelling per data folder: `vitlab evaluate RUN --data /data/shapes/` (tab completion's trailing slash) was
not the run's own '/data/shapes', so the evaluation drew other splits and tested on the run's training images."""

from vitlab.data.load import absolute_source
from vitlab.evaluate.loading import is_runs_data


def test_trailing_slash_and_dot_name_the_same_folder(tmp_path):
    folder = tmp_path / "shapes"
    folder.mkdir()
    for spelling in (f"{folder}/", f"{folder}/.", f"{folder}//", str(folder)):
        assert absolute_source(spelling) == str(folder)
        assert is_runs_data(spelling, {"data": str(folder)})
    assert absolute_source(f"hf:{folder}/") == f"hf:{folder}"
    assert not is_runs_data(f"{folder}/other", {"data": str(folder)})
    assert absolute_source("fashion-mnist") == "fashion-mnist"  # names stay as given
