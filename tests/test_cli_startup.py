"""`vitlab --help` starts at once: building the parser imports none of the heavy libraries."""

import subprocess
import sys

HEAVY = ["torch", "numpy", "matplotlib", "PIL", "safetensors", "sklearn"]


def test_parser_does_not_import_heavy_libraries():
    code = ("import sys, vitlab, vitlab.cli; vitlab.cli.build_parser(); "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "", f"building the parser imported {out.strip()}"


def test_lazy_names_still_resolve():
    import vitlab
    from vitlab import ViTConfig, create_model

    assert vitlab.create_model is create_model
    assert vitlab.ViTConfig is ViTConfig
    assert {"create_model", "VisionTransformer", "model_names"} <= set(dir(vitlab))
