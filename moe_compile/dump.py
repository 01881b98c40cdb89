"""HIERMOE_DUMP_DIR: write every compile's report and before/after graph code to a directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.fx as fx

from moe_compile.report import GraphReport, Report


def dump_graph_report(directory: str, report: GraphReport, gm: fx.GraphModule) -> Path:
    """Write ``graph_<n>`` files (and an SVG where graphviz and pydot are installed)."""
    rank = os.environ.get("RANK", "0")
    out = Path(directory) / f"rank{rank}"
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"graph_{report.index:03d}"
    whole = Report(graphs=[report])
    stem.with_name(stem.name + "_before.py").write_text(report.before)
    stem.with_name(stem.name + "_after.py").write_text(report.after)
    stem.with_name(stem.name + "_report.txt").write_text(str(whole))
    stem.with_name(stem.name + "_report.json").write_text(whole.to_json())
    if shutil.which("dot") is not None:
        try:
            from torch.fx.passes.graph_drawer import FxGraphDrawer

            drawer = FxGraphDrawer(gm, f"graph_{report.index}")
            stem.with_name(stem.name + "_after.svg").write_bytes(drawer.get_dot_graph().create_svg())
        except ImportError:  # pydot missing: the text dumps above are complete without the picture
            pass
    return out


def dump_scheduled(directory: str, report: GraphReport, code: str) -> Path:
    """Write the ``k``-th graph AOTAutograd made of this one (0 forward, 1 backward) as split by
    ``passes.overlap`` (``report.scheduled[k]`` holds it), ``graph_<n>_scheduled_<k>.py``."""
    out = Path(directory) / f"rank{os.environ.get('RANK', '0')}"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"graph_{report.index:03d}_scheduled_{len(report.scheduled) - 1}.py"
    path.write_text(code)
    return path
