"""`gradsync compare REF A B`: each compared pair gets its own default tolerance."""

from __future__ import annotations

import torch

from gradsync.checkpoint import save_checkpoint
from gradsync.cli import main


def test_compare_chooses_the_tolerance_per_pair(capsys, tmp_path):
    """Probe 30b: a float32 checkpoint beside a float64 pair set 1e-5 for both pairs."""
    meta = {"model": "m", "preset": "tiny"}
    near = torch.ones(3, dtype=torch.float64)
    save_checkpoint(tmp_path / "ref.safetensors", {"param/w": near}, meta)
    save_checkpoint(tmp_path / "f64.safetensors", {"param/w": near + 1e-7}, meta)
    save_checkpoint(tmp_path / "f32.safetensors", {"param/w": near.float()}, meta)
    paths = [str(tmp_path / f"{n}.safetensors") for n in ("ref", "f64", "f32")]
    assert main(["compare", *paths]) == 1
    out = capsys.readouterr().out
    f64_table, f32_table = "".join(out.split()).split("compared")[1:]  # titles wrap
    assert "maxabs≤1e-09,thedefaultforthispair" in f64_table and "BEYOND" in f64_table
    assert "maxabs≤1e-05,thedefaultforthispair" in f32_table and "BEYOND" not in f32_table
    assert "1 tensor(s) beyond tolerance" in out
