"""A flipped byte inside a torch file (a disk or copy error) is refused by the CRC-32 its zip records: torch.load
checks none, and loaded the changed tensor without a word (weights through vitlab.load, checkpoints on resume)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

import vitlab
from test_train_lifecycle import assert_same_weights, resume_cfg, run_interrupted, tiny_cfg
from test_train_loop import tiny_data
from vitlab.errors import VitlabError
from vitlab.train import train


def flip_a_byte_in_the_largest_member(path: Path) -> None:
    """Change one byte of the largest tensor's data, leaving the zip's structure whole."""
    with zipfile.ZipFile(path) as z:
        member = max(z.infolist(), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_and_extra = int.from_bytes(data[member.header_offset + 26:member.header_offset + 28], "little") + \
        int.from_bytes(data[member.header_offset + 28:member.header_offset + 30], "little")
    data[member.header_offset + 30 + name_and_extra + member.file_size // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_weights_with_a_flipped_byte_are_refused(tmp_path):
    model = vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=4, image_size=16,
                                num_classes=3, seed=0)
    path = tmp_path / "model.pth"
    torch.save(model.state_dict(), path)
    flip_a_byte_in_the_largest_member(path)
    assert torch.load(path, weights_only=True)  # torch itself loads it, changed
    with pytest.raises(VitlabError, match=r"is damaged: its part .* fails the checksum"):
        vitlab.load(path, heads=2)


def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(tmp_path, monkeypatch, capsys):
    ref = train(tiny_cfg(tmp_path, name="ref"), data=tiny_data())
    run = run_interrupted(tmp_path, monkeypatch, step=5)  # checkpoints at 4 and 5
    flip_a_byte_in_the_largest_member(run / "checkpoints" / "step-0000005.pt")
    capsys.readouterr()
    resumed = train(resume_cfg(run), data=tiny_data())
    shown = capsys.readouterr()
    assert "step-0000005.pt is unreadable" in shown.err and "resuming from step 4" in shown.out
    assert_same_weights(ref.model, resumed.model)  # from step 4, still exact; step 5's changed bytes were not used


def test_a_damaged_checkpoint_named_alone_is_one_line(tmp_path, monkeypatch):
    run = run_interrupted(tmp_path, monkeypatch, step=5)
    path = run / "checkpoints" / "step-0000005.pt"
    flip_a_byte_in_the_largest_member(path)
    from vitlab.train.checkpoint import load_resume_state

    with pytest.raises(VitlabError, match=r"is damaged.*resume from another one") as info:
        load_resume_state(path)  # what `vitlab train --resume RUN/checkpoints/step-N.pt` reads
    assert "\n" not in str(info.value)
