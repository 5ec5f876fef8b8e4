"""Configuration the selector reads besides first principles: the FLYQUANT_TUNING table that
bench/ writes on hardware (the fastest MoE GEMM config per op, arch and shape) and FLYQUANT_CONFIG's
forced fields. Both are checked whole when read: a malformed value is an EnvError naming the
variable, the value and the expected form (the selector then checks every table entry's values
against the kernels, at the first MoE plan)."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import torch

from . import env
from .arch import ARCHS

MOE_CONFIG_FIELDS = ("tile_m", "tile_n", "k_batch", "waves")
MOE_SHAPE_FIELDS = ("tokens", "topk", "experts", "model_dim", "inter_dim")
# The ops a tuning table may hold: op -> (its shape fields, all required; its config fields).
TUNED_OPS = {"moe_gemm2_a16w4": (MOE_SHAPE_FIELDS, MOE_CONFIG_FIELDS),
             "moe_gemm1_a16w4": (MOE_SHAPE_FIELDS, ("tile_m", "tile_n", "waves"))}  # stage 1: no split K
TUNING_TABLE_KEYS = ("entries",)
TUNING_ENTRY_KEYS = ("op", "arch", "shape", "config")
TUNING_ENTRY_NOTES = ("median_us",)  # what bench/ records beside an entry; read and ignored


def _keys(where: str, value: dict, known, required=()) -> None:
    """`value`'s keys are among `known` (and include `required`), else an EnvError listing them."""
    unknown = [k for k in value if k not in known]
    if unknown:
        raise env.EnvError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    missing = [k for k in required if k not in value]
    if missing:
        raise env.EnvError(f"{where}: missing key(s) {', '.join(map(repr, missing))} (required: {', '.join(required)})")


def _positive_ints(where: str, fields: dict) -> dict[str, int]:
    for k, v in fields.items():
        if type(v) is not int or v <= 0:  # bool is an int subclass: refused too
            raise env.EnvError(f"{where}: {k} = {json.dumps(v)}: expected a positive integer")
    return dict(fields)


class _DuplicateKeys(ValueError):
    pass


def _unique_keys(pairs: list) -> dict:
    """json's object_pairs_hook: an object naming a key twice is refused (json keeps the last one,
    silently: {"tile_n": 128, "tile_n": 64} forced 64)."""
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise _DuplicateKeys(f"key(s) {', '.join(map(repr, twice))} given twice in one JSON object")
    return dict(pairs)


def _object(where: str, value, example: str) -> dict:
    if not isinstance(value, dict):
        raise env.EnvError(f"{where} = {json.dumps(value)}: expected a JSON object, e.g. {example}")
    return value


def config_overrides() -> dict[str, Any]:
    """FLYQUANT_CONFIG: a JSON object of MoE configuration fields (MOE_CONFIG_FIELDS, positive
    integers) forced for debugging; {} when unset. Anything else is an EnvError naming it."""
    raw = env.raw("FLYQUANT_CONFIG")
    if raw is None:
        return {}
    try:
        value = json.loads(raw, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise env.error("FLYQUANT_CONFIG", raw, f"{env.VARIABLES['FLYQUANT_CONFIG']} ({exc})") from None
    except _DuplicateKeys as exc:
        raise env.EnvError(f"FLYQUANT_CONFIG={raw!r}: {exc}") from None
    if not isinstance(value, dict):
        raise env.error("FLYQUANT_CONFIG", raw, env.VARIABLES["FLYQUANT_CONFIG"])
    _keys(f"FLYQUANT_CONFIG={raw!r}", value, MOE_CONFIG_FIELDS)
    return _positive_ints(f"FLYQUANT_CONFIG={raw!r}", value)


def _tuning_entry(where: str, e) -> tuple[tuple, dict]:
    """One checked table entry -> ((op, arch, sorted shape items), config)."""
    _object(where, e, '{"op": ..., "arch": ..., "shape": {...}, "config": {...}}')
    _keys(where, e, TUNING_ENTRY_KEYS + TUNING_ENTRY_NOTES, TUNING_ENTRY_KEYS)
    if e["op"] not in TUNED_OPS:
        raise env.EnvError(f"{where}.op = {json.dumps(e['op'])}: expected one of {', '.join(TUNED_OPS)}")
    if e["arch"] not in ARCHS:
        raise env.EnvError(f"{where}.arch = {json.dumps(e['arch'])}: expected one of {', '.join(sorted(ARCHS))}")
    shape_fields, config_fields = TUNED_OPS[e["op"]]
    shape = _object(f"{where}.shape", e["shape"], "{" + ", ".join(f'"{f}": ...' for f in shape_fields) + "}")
    _keys(f"{where}.shape", shape, shape_fields, shape_fields)
    config = _object(f"{where}.config", e["config"], '{"tile_n": 128}')
    _keys(f"{where}.config", config, config_fields)
    key = (e["op"], e["arch"], tuple(sorted(_positive_ints(f"{where}.shape", shape).items())))
    return key, _positive_ints(f"{where}.config", config)


class Table:
    """A checked FLYQUANT_TUNING table: `entries` [(index, op, arch, shape, config)] in the file's
    order, and `by_shape` {(op, arch, shape fields but tokens): [(tokens, index, config)] sorted}."""

    def __init__(self, entries: list[tuple[int, str, str, dict, dict]]):
        self.entries = entries
        self.by_shape: dict[tuple, list] = {}
        for i, op, arch, shape, config in entries:
            rest = tuple(sorted((k, v) for k, v in shape.items() if k != "tokens"))
            self.by_shape.setdefault((op, arch, rest), []).append((shape["tokens"], i, config))
        for points in self.by_shape.values():
            points.sort(key=lambda point: point[:2])


EMPTY = Table([])


@functools.lru_cache(maxsize=8)
def _load_tuning(path: str, mtime: float) -> Table:
    """The table at `path` (FLYQUANT_TUNING), checked whole: {"entries": [entry, ...]}, each entry
    {"op", "arch", "shape": every shape field, "config": config fields}, one entry per key."""
    where = f"FLYQUANT_TUNING={path!r}"
    try:
        with open(path) as f:
            table = json.load(f, object_pairs_hook=_unique_keys)
    except OSError as exc:
        raise env.error("FLYQUANT_TUNING", path, f"{env.VARIABLES['FLYQUANT_TUNING']}; reading it failed: {exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise env.EnvError(f"{where}: the file is not JSON ({exc})") from None
    except _DuplicateKeys as exc:
        raise env.EnvError(f"{where}: {exc}") from None
    _object(where, table, '{"entries": [...]}')
    _keys(where, table, TUNING_TABLE_KEYS, TUNING_TABLE_KEYS)
    if not isinstance(table["entries"], list):
        raise env.EnvError(f"{where}: entries must be a JSON list, got {type(table['entries']).__name__}")
    first: dict[tuple, int] = {}
    entries = []
    for i, e in enumerate(table["entries"]):
        key, config = _tuning_entry(f"{where}: entries[{i}]", e)
        if key in first:
            raise env.EnvError(f"{where}: entries[{first[key]}] and entries[{i}] are both for {key}: keep one")
        first[key] = i
        entries.append((i, key[0], key[1], dict(key[2]), config))
    return Table(entries)


def loaded_table() -> Table:
    """The FLYQUANT_TUNING table (the same object while the file is unchanged); EMPTY when unset.
    While torch.compile traces, the table as constants (_traced_entries): dynamo cannot trace the
    file's reading, and a graph compiled with a table keeps it."""
    if torch.compiler.is_compiling():
        return Table([(i, op, arch, dict(shape), dict(config)) for i, op, arch, shape, config in _traced_entries()])
    return _read_table()


def check_entries(table: Table) -> None:
    """Every entry of `table` against the kernels (flyquant.select.tuning_entry_problem), an
    EnvError naming the first bad one."""
    from .select import tuning_entry_problem  # select imports this module

    for i, op, arch, shape, config in table.entries:
        problem = tuning_entry_problem(op, shape, config)
        if problem:
            raise env.EnvError(f"FLYQUANT_TUNING={env.raw('FLYQUANT_TUNING')!r}: entries[{i}] ({op}, {arch}, {shape}): "
                               f"{problem}")


def _traced_entries() -> tuple:
    """The table's entries as constants (shape and config as item tuples), read and checked whole
    (check_entries) when torch.compile traces."""
    table = _read_table()
    check_entries(table)
    return tuple((i, op, arch, tuple(sorted(shape.items())), tuple(config.items())) for i, op, arch, shape, config in
                 table.entries)


# torch._dynamo.assume_constant_result(_traced_entries), its whole effect (torch/_dynamo/decorators.py), without
# importing dynamo when flyquant is imported (1.5 s): dynamo calls the function while tracing and keeps its result
_traced_entries._dynamo_marked_constant = True


def _read_table() -> Table:
    path = env.absolute_path("FLYQUANT_TUNING")
    if path is None:
        return EMPTY
    try:
        mtime = os.path.getmtime(path)
    except OSError as exc:
        raise env.error("FLYQUANT_TUNING", path, f"{env.VARIABLES['FLYQUANT_TUNING']} ({exc.strerror})") from None
    return _load_tuning(path, mtime)


def tuning_table() -> dict[tuple, dict]:
    """The FLYQUANT_TUNING table, {(op, arch, sorted shape items): config}; {} when unset. The
    whole table is checked when it is first read (and again when the file changes)."""
    return {(op, arch, tuple(sorted(shape.items()))): config for _, op, arch, shape, config in loaded_table().entries}


NEAREST_FACTOR = 2  # an entry serves token counts within this factor of its own (a sweep's points are powers of 2)


def tuned_entry(op: str, arch: str, shape: dict[str, Any]) -> tuple[int, int, dict] | None:
    """(index, tokens, config) of the table's entry for this (op, arch, shape), or None. Token
    counts are a sweep's sample points (bench/moe_tile_n.py: 1, 2, 4, ... 4096), so the entry is
    the one with the other shape fields equal and the nearest tokens by ratio, within a factor of
    NEAREST_FACTOR (a tie: the fewer; a table of 4096-token points does not drive a 1-token
    decode). Compared by name alone: torch.compile cannot sort symbolic sizes (a table entry makes
    it specialize on them)."""
    table = loaded_table()
    if not table.entries:
        return None
    rest = tuple((k, int(v)) for k, v in sorted(shape.items(), key=lambda item: item[0]) if k != "tokens")
    points = table.by_shape.get((op, arch, rest))
    tokens = int(shape["tokens"])
    if not points or tokens <= 0:
        return None
    best = None
    for t, i, config in points:  # sorted by tokens: the first of equal ratios is the fewer
        ratio = max(t / tokens, tokens / t)
        if ratio <= NEAREST_FACTOR and (best is None or ratio < best[0]):
            best = ratio, (i, t, dict(config))
    return best[1] if best else None


def tuned_config(op: str, arch: str, shape: dict[str, Any]) -> dict[str, Any]:
    """The configuration of tuned_entry(op, arch, shape), or {}."""
    entry = tuned_entry(op, arch, shape)
    return entry[2] if entry else {}
