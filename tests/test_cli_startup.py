"""`vitlab --help` starts at once: building the parser imports none of the heavy libraries; `vitlab models`
and `vitlab models --pretrained` print their tables without importing torch (issue 18 item 5)."""

import subprocess
import sys

import pytest

HEAVY = ["torch", "numpy", "matplotlib", "PIL", "safetensors", "sklearn", "onnxruntime", "openvino"]


def test_parser_does_not_import_heavy_libraries():
    code = ("import sys, vitlab, vitlab.cli; vitlab.cli.build_parser(); "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "", f"building the parser imported {out.strip()}"


@pytest.mark.parametrize("argv", [["models"], ["models", "--pretrained"]])
def test_models_tables_do_not_import_heavy_libraries(argv):
    code = ("import sys, contextlib, io, vitlab.cli\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            f"    rc = vitlab.cli.main({argv!r})\n"
            "assert rc == 0 and out.getvalue().count(chr(10)) > 40, out.getvalue()\n"
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "", f"`vitlab {' '.join(argv)}` imported {out.strip()}"


def test_lazy_names_still_resolve():
    import vitlab
    from vitlab import ViTConfig, create_model

    assert vitlab.create_model is create_model
    assert vitlab.ViTConfig is ViTConfig
    assert {"create_model", "VisionTransformer", "model_names"} <= set(dir(vitlab))


def test_cli_engine_choices_are_the_engine_packages():
    # spelled out in the CLI so that building the parser imports nothing: kept in step here
    from vitlab.commands._engine_args import ENGINE_CHOICES, INT8_CHOICES
    from vitlab.engine import ENGINES, INT8_MODES

    assert ENGINE_CHOICES == ENGINES and INT8_CHOICES == INT8_MODES
