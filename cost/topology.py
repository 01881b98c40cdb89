"""Cluster topology: the levels of a cluster (slowest first) with alpha-beta link models, and
per-device compute.  Built from a DeviceMesh (mesh dim names = level names), or read from /
written to a TOML file.

Assumptions: a message of n bytes over a link of level i takes ``alpha_s + n * beta_s_per_byte``
seconds (the alpha-beta model HierMoE fits in its Section V-B and Fig. 9); level i has ``size``
members inside one member of level i-1 (a mesh dimension); ``world_size`` is the product of the
sizes.  ``efficiency`` holds MoNTA's measured efficiency curves r(size): for a collective name,
message sizes in bytes and the fraction of link bandwidth reached at that size.

TOML layout (every field named in errors):

    name = "2-node DGX H100"
    [[levels]]                      # slowest first
    name = "node"
    size = 2
    alpha_s = 5e-6
    beta_s_per_byte = 2.5e-11       # or: bandwidth_gbps = 400 (gigabits per second)
    [compute]
    flops_per_s = 9.89e14           # one value, or a list with one value per device
    mem_bw_bytes_per_s = 3.35e12
    chunk_overhead_s = 6e-3         # optional: the fixed cost of one more pipeline chunk, per
                                    # direction, measured (cost.pipeline.fit_chunk_overhead)
    expert_flops_per_s = 3.1e10     # optional, both or neither: the expert op measured on the
    expert_row_bytes_per_s = 2.7e8  # device (cost.calibrate.fit_expert_compute): the FLOP rate
                                    # of its matmuls, and the rate of its per-(token, expert) row
                                    # work (gather, weight, sum into tokens), in row bytes
    [efficiency.all_to_all]         # optional, any collective name
    sizes_bytes = [1024, 1048576]
    values = [0.1, 0.9]
"""

from __future__ import annotations

import difflib
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Level:
    name: str
    size: int
    alpha_s: float
    beta_s_per_byte: float

    @property
    def bandwidth_gbps(self) -> float:
        return 8.0 / self.beta_s_per_byte / 1e9

    def time_s(self, num_bytes: float, num_messages: float = 1.0) -> float:
        """alpha-beta time of ``num_messages`` messages carrying ``num_bytes`` in total."""
        return num_messages * self.alpha_s + num_bytes * self.beta_s_per_byte


@dataclass(frozen=True)
class EfficiencyCurve:
    """Piecewise-linear r(size): fraction of the link bandwidth a collective reaches at a size."""

    sizes_bytes: tuple[float, ...]
    values: tuple[float, ...]

    def __call__(self, size_bytes: float) -> float:
        xs, ys = self.sizes_bytes, self.values
        if size_bytes <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if size_bytes <= x1:
                return y0 + (y1 - y0) * (size_bytes - x0) / (x1 - x0)
        return ys[-1]


@dataclass(frozen=True)
class Topology:
    levels: tuple[Level, ...]
    flops_per_s: tuple[float, ...] = (1e12,)
    mem_bw_bytes_per_s: tuple[float, ...] = (1e11,)
    efficiency: Mapping[str, EfficiencyCurve] = field(default_factory=dict)
    name: str = ""
    # the fixed cost of one more chunk of the expert-parallel pipeline, per direction, measured
    # (cost.pipeline; None: its default OP_OVERHEAD_S)
    chunk_overhead_s: float | None = None
    # the expert op measured on the device (``expert_compute_s``; None: not measured, the expert
    # FFNs charged at ``flops_per_s`` alone)
    expert_flops_per_s: float | None = None
    expert_row_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        pair = (self.expert_flops_per_s, self.expert_row_bytes_per_s)
        if (pair[0] is None) != (pair[1] is None):
            raise ValueError("topology: compute.expert_flops_per_s and compute.expert_row_bytes_per_s are one "
                             f"measurement: give both or neither, got {pair}")
        if pair[0] is not None and not all(isinstance(v, int | float) and not isinstance(v, bool)
                                           and math.isfinite(v) and v > 0 for v in pair):
            raise ValueError(f"topology: compute.expert_flops_per_s and compute.expert_row_bytes_per_s must be "
                             f"positive finite numbers, got {pair}")
        if self.chunk_overhead_s is not None and not (math.isfinite(self.chunk_overhead_s)
                                                      and self.chunk_overhead_s >= 0):
            raise ValueError(f"topology: compute.chunk_overhead_s must be a finite number of seconds >= 0, "
                             f"got {self.chunk_overhead_s!r}")
        if not self.levels:
            raise ValueError("topology: 'levels' must list at least one level, slowest first")
        names = [lv.name for lv in self.levels]
        if len(set(names)) != len(names):
            raise ValueError(f"topology: level names must be unique, got {names}")
        for field_name, values in (("flops_per_s", self.flops_per_s), ("mem_bw_bytes_per_s", self.mem_bw_bytes_per_s)):
            if len(values) not in (1, self.world_size):
                raise ValueError(f"topology: compute.{field_name} must be one value or one per device "
                                 f"({self.world_size}), got {len(values)}")

    @property
    def world_size(self) -> int:
        return math.prod(lv.size for lv in self.levels)

    @property
    def level_names(self) -> tuple[str, ...]:
        return tuple(lv.name for lv in self.levels)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(lv.size for lv in self.levels)

    def level(self, name: str) -> Level:
        for lv in self.levels:
            if lv.name == name:
                return lv
        raise ValueError(f"topology has no level {name!r}; levels are {list(self.level_names)}")

    def device_flops(self, rank: int) -> float:
        return self.flops_per_s[rank if len(self.flops_per_s) > 1 else 0]

    def device_mem_bw(self, rank: int) -> float:
        return self.mem_bw_bytes_per_s[rank if len(self.mem_bw_bytes_per_s) > 1 else 0]

    def copy_s(self, num_bytes: float, rank: int = 0) -> float:
        """Seconds device ``rank`` takes to copy ``num_bytes`` in its memory (packing a message,
        unpacking what arrived): at the expert op's measured row rate where calibration measured
        it (``expert_row_bytes_per_s``: whole rows moved under the ranks' own contention, what a
        copy of gathered weights meets on a shared CPU), else a read and a write at
        ``mem_bw_bytes_per_s``."""
        if self.expert_row_bytes_per_s is not None:
            return num_bytes / self.expert_row_bytes_per_s
        return 2.0 * num_bytes / self.device_mem_bw(rank)

    def expert_compute_s(self, flops: float, row_bytes: float, rank: int = 0) -> float:
        """Seconds the expert op takes on device ``rank`` for ``flops`` of matmuls over (token,
        expert) rows of ``row_bytes`` in all (rows x H x element bytes): with the op measured
        (``expert_flops_per_s``, ``expert_row_bytes_per_s``) ``flops / expert_flops_per_s +
        row_bytes / expert_row_bytes_per_s``, the second term the work on whole H-wide rows
        (gathering them, weighting them, summing them into their tokens) that does not shrink with
        the FFN columns a device computes; else ``flops / flops_per_s``. The measured rates are one
        value for every device (the ranks' median, ``tools.calibrate.measure_expert_compute``)."""
        if self.expert_flops_per_s is None or self.expert_row_bytes_per_s is None:
            return flops / self.device_flops(rank)
        return flops / self.expert_flops_per_s + row_bytes / self.expert_row_bytes_per_s

    # construction -------------------------------------------------------------------------

    @classmethod
    def from_mesh(cls, mesh: Any, links: Mapping[str, Mapping[str, float]], *,
                  flops_per_s: float | Sequence[float] = 1e12,
                  mem_bw_bytes_per_s: float | Sequence[float] = 1e11, name: str = "",
                  world_size: int | None = None) -> Topology:
        """From a ``DeviceMesh`` whose dim names are the levels (slowest first) and per-level link
        parameters ``{"node": {"alpha_s": ..., "beta_s_per_byte": ...}, ...}`` (or
        ``bandwidth_gbps`` instead of beta).  The mesh must span the whole world."""
        dim_names = getattr(mesh, "mesh_dim_names", None)
        if not dim_names:
            raise ValueError("the DeviceMesh needs mesh_dim_names, one per topology level (slowest first), "
                             "e.g. init_device_mesh('cpu', (2, 4), mesh_dim_names=('node', 'gpu'))")
        shape = tuple(int(s) for s in mesh.mesh.shape)
        unknown = sorted(set(links) - set(dim_names))
        if unknown:
            raise ValueError(f"link parameters for unknown level(s) {unknown}; mesh levels are {list(dim_names)}")
        missing = [n for n in dim_names if n not in links]
        if missing:
            raise ValueError(f"no link parameters for level(s) {missing}; give alpha_s and beta_s_per_byte "
                             "(or bandwidth_gbps) for every mesh dimension")
        if world_size is None:
            import torch.distributed as dist

            world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else math.prod(shape)
        if math.prod(shape) != world_size:
            raise ValueError(f"the mesh has {math.prod(shape)} devices {shape} but the world size is {world_size}; "
                             "the mesh must cover every rank")
        levels = tuple(_level(n, s, links[n], f"links.{n}") for n, s in zip(dim_names, shape))
        return cls(levels=levels, flops_per_s=_floats(flops_per_s), mem_bw_bytes_per_s=_floats(mem_bw_bytes_per_s),
                   name=name)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        """From the TOML layout above; an unknown key (a misspelled table or field) or two keys
        that say the same thing (``beta_s_per_byte`` and ``bandwidth_gbps``) is an error."""
        _check_keys(data, ("name", "levels", "compute", "efficiency"), "the top level")
        levels_raw = data.get("levels")
        if not isinstance(levels_raw, list) or not levels_raw:
            raise ValueError("topology: 'levels' must be a non-empty array of tables ([[levels]]), slowest first")
        levels = []
        for i, raw in enumerate(levels_raw):
            where = f"levels[{i}]"
            if not isinstance(raw, Mapping):
                raise ValueError(f"topology: {where} must be a table with name, size, alpha_s and beta_s_per_byte")
            _check_keys(raw, ("name", "size", *_LINK_KEYS), where)
            if not isinstance(raw.get("name"), str):
                raise ValueError(f"topology: {where}.name must be a string")
            size = raw.get("size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"topology: {where}.size must be a positive integer, got {size!r}")
            levels.append(_level(raw["name"], size, raw, where))
        compute = data.get("compute", {})
        if not isinstance(compute, Mapping):
            raise ValueError("topology: 'compute' must be a table with flops_per_s and mem_bw_bytes_per_s")
        _check_keys(compute, ("flops_per_s", "mem_bw_bytes_per_s", "chunk_overhead_s", *_EXPERT_KEYS), "compute")
        overhead = compute.get("chunk_overhead_s")
        if overhead is not None and (not isinstance(overhead, int | float) or isinstance(overhead, bool)):
            raise ValueError(f"topology: compute.chunk_overhead_s must be a number of seconds, got {overhead!r}")
        efficiency = {}
        for op, raw in (data.get("efficiency") or {}).items():
            where = f"efficiency.{op}"
            if not isinstance(raw, Mapping):
                raise ValueError(f"topology: {where} must be a table with sizes_bytes and values")
            _check_keys(raw, ("sizes_bytes", "values"), where)
            xs, ys = raw.get("sizes_bytes"), raw.get("values")
            if not isinstance(xs, list) or not isinstance(ys, list) or len(xs) != len(ys) or not xs:
                raise ValueError(f"topology: {where} needs equally long non-empty arrays sizes_bytes and values")
            if any(b <= a for a, b in zip(xs, xs[1:])):
                raise ValueError(f"topology: {where}.sizes_bytes must be strictly increasing")
            efficiency[op] = EfficiencyCurve(tuple(float(x) for x in xs), tuple(float(y) for y in ys))
        return cls(levels=tuple(levels),
                   flops_per_s=_floats(compute.get("flops_per_s", 1e12), "compute.flops_per_s"),
                   mem_bw_bytes_per_s=_floats(compute.get("mem_bw_bytes_per_s", 1e11), "compute.mem_bw_bytes_per_s"),
                   efficiency=efficiency, name=str(data.get("name", "")),
                   chunk_overhead_s=None if overhead is None else float(overhead),
                   **{k: _optional_float(compute.get(k), f"compute.{k}") for k in _EXPERT_KEYS})

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"topology file {path} is not valid TOML: {e}") from e
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        out["levels"] = [{"name": lv.name, "size": lv.size, "alpha_s": lv.alpha_s,
                          "beta_s_per_byte": lv.beta_s_per_byte} for lv in self.levels]
        out["compute"] = {"flops_per_s": _one_or_list(self.flops_per_s),
                          "mem_bw_bytes_per_s": _one_or_list(self.mem_bw_bytes_per_s)}
        if self.chunk_overhead_s is not None:
            out["compute"]["chunk_overhead_s"] = self.chunk_overhead_s
        for k in _EXPERT_KEYS:
            if getattr(self, k) is not None:
                out["compute"][k] = getattr(self, k)
        if self.efficiency:
            out["efficiency"] = {op: {"sizes_bytes": list(c.sizes_bytes), "values": list(c.values)}
                                 for op, c in self.efficiency.items()}
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(_to_toml(self.to_dict()))


_LINK_KEYS = ("alpha_s", "beta_s_per_byte", "bandwidth_gbps")
_EXPERT_KEYS = ("expert_flops_per_s", "expert_row_bytes_per_s")


def _optional_float(v: Any, where: str) -> float | None:
    if v is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise ValueError(f"topology: {where} must be a number, got {v!r}")
    return float(v)


def _check_keys(raw: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    unknown = [k for k in raw if k not in allowed]
    if unknown:
        hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, allowed, n=1)) else repr(k)
                 for k in unknown]
        raise ValueError(f"topology: unknown key(s) {', '.join(hints)} in {where}; valid keys there are "
                         f"{list(allowed)}")


def _level(name: str, size: int, raw: Mapping[str, Any], where: str) -> Level:
    _check_keys({k: v for k, v in raw.items() if k not in ("name", "size")}, _LINK_KEYS, where)
    if "beta_s_per_byte" in raw and "bandwidth_gbps" in raw:
        raise ValueError(f"topology: {where} gives both beta_s_per_byte and bandwidth_gbps, which say the same "
                         "thing (beta = 8 / (bandwidth_gbps * 1e9) seconds per byte); keep one")
    alpha = raw.get("alpha_s")
    if not isinstance(alpha, int | float) or alpha < 0:
        raise ValueError(f"topology: {where}.alpha_s must be a non-negative number of seconds, got {alpha!r}")
    beta = raw.get("beta_s_per_byte")
    if beta is None and "bandwidth_gbps" in raw:
        gbps = raw["bandwidth_gbps"]
        if not isinstance(gbps, int | float) or gbps <= 0:
            raise ValueError(f"topology: {where}.bandwidth_gbps must be a positive number, got {gbps!r}")
        beta = 8.0 / (gbps * 1e9)
    if not isinstance(beta, int | float) or beta <= 0:
        raise ValueError(f"topology: {where} needs beta_s_per_byte (seconds per byte, > 0) or bandwidth_gbps, "
                         f"got {beta!r}")
    return Level(name=name, size=size, alpha_s=float(alpha), beta_s_per_byte=float(beta))


def _floats(v: float | Sequence[float], where: str = "compute") -> tuple[float, ...]:
    values = [v] if isinstance(v, int | float) else list(v)
    if not values or any(not isinstance(x, int | float) or x <= 0 for x in values):
        raise ValueError(f"topology: {where} must be a positive number or a list of them, got {v!r}")
    return tuple(float(x) for x in values)


def _one_or_list(values: tuple[float, ...]) -> float | list[float]:
    return values[0] if len(values) == 1 else list(values)


def _to_toml(data: Mapping[str, Any]) -> str:
    """TOML for exactly the layout documented above (scalars, arrays of numbers, tables)."""
    lines = [f"name = {_toml_value(data.get('name', ''))}", ""]
    for lv in data["levels"]:
        lines.append("[[levels]]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in lv.items()]
        lines.append("")
    lines.append("[compute]")
    lines += [f"{k} = {_toml_value(v)}" for k, v in data["compute"].items()]
    for op, curve in data.get("efficiency", {}).items():
        lines += ["", f"[efficiency.{op}]"] + [f"{k} = {_toml_value(v)}" for k, v in curve.items()]
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to a topology file")
