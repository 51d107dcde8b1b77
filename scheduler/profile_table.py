"""A latency profile on a grid, interpolated: the measured (or generated) source of the latency model.

File format (JSON, version 1):
    {"version": 1, "model": str, "device": str, "source": str,
     "num_prefill_tokens": [..], "num_decode_seqs": [..], "num_kv_tokens": [..],   # strictly increasing axes
     "time_s": [[[..]]]}                                                            # time_s[p][d][k], seconds
Between grid points the time is trilinear in the three inputs: exact on the grid, and monotone wherever the table
is (each value is a weighted mean of neighbours). Past an axis' ends the edge cell's slope extends the table, so
a batch larger than anything profiled is predicted to cost more, never the same.
"""
from __future__ import annotations

import json
import math
from bisect import bisect_right
from pathlib import Path
from typing import Sequence

FORMAT_VERSION = 1
AXES = ("num_prefill_tokens", "num_decode_seqs", "num_kv_tokens")


class ProfileTable:
    def __init__(self, num_prefill_tokens: Sequence[float], num_decode_seqs: Sequence[float],
                 num_kv_tokens: Sequence[float], time_s: Sequence[Sequence[Sequence[float]]],
                 model: str = "", device: str = "", source: str = ""):
        axes = (list(num_prefill_tokens), list(num_decode_seqs), list(num_kv_tokens))
        for name, axis in zip(AXES, axes):
            if len(axis) < 2:
                raise ValueError(f"profile axis {name} needs at least two points, got {axis}")
            if any(not b > a for a, b in zip(axis, axis[1:])) or axis[0] < 0:
                raise ValueError(f"profile axis {name} must be non-negative and strictly increasing, got {axis}")
        shape = tuple(len(a) for a in axes)
        if len(time_s) != shape[0] or any(len(row) != shape[1] for row in time_s) \
                or any(len(col) != shape[2] for row in time_s for col in row):
            raise ValueError(f"time_s must be nested as [{shape[0]}][{shape[1]}][{shape[2]}] to match the axes")
        grid = [[[float(t) for t in col] for col in row] for row in time_s]
        for t in (t for row in grid for col in row for t in col):
            if not (math.isfinite(t) and t >= 0):
                raise ValueError(f"profile times must be finite and non-negative, got {t}")
        self.model, self.device, self.source = model, device, source
        self._axes = tuple(tuple(float(x) for x in a) for a in axes)
        self._grid = grid
        # One extra grid point past each axis' end, on the edge cell's line: every real grid point is then the
        # lower corner of a cell (interpolation weight 0: exact), and the padding cell extrapolates.
        p, d, k = (a + (2 * a[-1] - a[-2],) for a in self._axes)
        padded = [[col + [2 * col[-1] - col[-2]] for col in row] for row in grid]
        padded = [row + [[2 * a - b for a, b in zip(row[-1], row[-2])]] for row in padded]
        padded.append([[2 * a - b for a, b in zip(c1, c2)] for c1, c2 in zip(padded[-1], padded[-2])])
        self._p, self._d, self._k = p, d, k
        self._flat = [t for row in padded for col in row for t in col]
        self._stride_d = len(k)
        self._stride_p = len(d) * len(k)

    @classmethod
    def from_dict(cls, data: dict) -> "ProfileTable":
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise ValueError(f"profile format version {version!r} is not supported (expected {FORMAT_VERSION})")
        missing = [key for key in (*AXES, "time_s") if key not in data]
        if missing:
            raise ValueError(f"profile lacks {', '.join(missing)}")
        return cls(data["num_prefill_tokens"], data["num_decode_seqs"], data["num_kv_tokens"], data["time_s"],
                   model=data.get("model", ""), device=data.get("device", ""), source=data.get("source", ""))

    @classmethod
    def load(cls, path: str | Path) -> "ProfileTable":
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"profile {path} is not valid JSON: {e}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        p, d, k = self._axes
        return {"version": FORMAT_VERSION, "model": self.model, "device": self.device, "source": self.source,
                "num_prefill_tokens": list(p), "num_decode_seqs": list(d), "num_kv_tokens": list(k),
                "time_s": [[list(col) for col in row] for row in self._grid]}

    def save(self, path: str | Path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    def predict(self, num_prefill_tokens: int, num_decode_seqs: int, num_kv_tokens: int) -> float:
        p, d, k = self._p, self._d, self._k
        # cell index on each axis; below the first point the first cell extrapolates, past the end the padding cell
        i = min(max(bisect_right(p, num_prefill_tokens) - 1, 0), len(p) - 2)
        j = min(max(bisect_right(d, num_decode_seqs) - 1, 0), len(d) - 2)
        m = min(max(bisect_right(k, num_kv_tokens) - 1, 0), len(k) - 2)
        tp = (num_prefill_tokens - p[i]) / (p[i + 1] - p[i])
        td = (num_decode_seqs - d[j]) / (d[j + 1] - d[j])
        tk = (num_kv_tokens - k[m]) / (k[m + 1] - k[m])
        f, sp, sd = self._flat, self._stride_p, self._stride_d
        base = i * sp + j * sd + m
        c00 = f[base] + (f[base + 1] - f[base]) * tk
        c01 = f[base + sd] + (f[base + sd + 1] - f[base + sd]) * tk
        c10 = f[base + sp] + (f[base + sp + 1] - f[base + sp]) * tk
        c11 = f[base + sp + sd] + (f[base + sp + sd + 1] - f[base + sp + sd]) * tk
        c0 = c00 + (c01 - c00) * td
        c1 = c10 + (c11 - c10) * td
        return c0 + (c1 - c0) * tp
